"""Router load of a mixture-of-experts denoiser: how many (token, expert) pairs each routed expert of every
MoE layer received, counted by forward hooks on the gates (DeepSeek-V3's layout: ``gate(x)`` returns
``(topk_idx [N, k], topk_weight, aux)``), with or without expert parallelism.

Logged per GRPO iteration (every forward of the policy since the previous log: rollouts, the update, and
the grids and guard probes of the step before; summed over ranks; a recompute in backward is not counted) as

- ``moe/load_max``: over layers, the largest expert's share over the mean share (1 = balanced; ``E / k``
  when every token picks the same ``k`` of ``E`` experts);
- ``moe/load_min``: over layers, the smallest expert's share over the mean (0: an expert no token reached);
- ``moe/idle_experts``: (layer, expert) pairs that received no token.

With expert parallelism an EP rank's load is the sum of its experts' shares (one expert per rank when
``ep`` equals the expert count): the busiest rank bounds an EP step's time (``expert.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RouterLoad:
    """Token counts per routed expert of ``layers`` (each with a ``gate`` and ``experts``), ``[L, E]`` int64,
    accumulated on the gate's device (no host sync per forward) from every forward until :meth:`pop`."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.sizes = [len(layer.experts) for layer in layers]
        self.counts: list[torch.Tensor | None] = [None] * len(layers)
        self.handles = [layer.gate.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, i: int):
        def count(_gate, _inputs, output):
            if torch._C._current_graph_task_id() != -1:
                return  # an activation-checkpoint recompute in backward: the forward was counted
            seen = torch.bincount(output[0].reshape(-1).detach(), minlength=self.sizes[i])
            self.counts[i] = seen if self.counts[i] is None else self.counts[i] + seen
        return count

    def pop(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """The metrics of the module notes since the last call, summed over ``group`` (collective when given;
        the same layers on every rank), and the counts reset; ``{}`` when nothing was routed."""
        if not self.sizes:
            return {}
        device = next((c.device for c in self.counts if c is not None), torch.device("cpu"))
        flat = torch.cat([torch.zeros(n, dtype=torch.long, device=device) if c is None else c
                          for c, n in zip(self.counts, self.sizes)])
        self.counts = [None] * len(self.sizes)
        if group is not None:
            dist.all_reduce(flat, group=group)
        layers = flat.cpu().split(self.sizes)
        if not int(flat.sum()):
            return {}
        shares = [c.double() / c.double().mean().clamp_min(1e-12) for c in layers]
        return {"moe/load_max": max(float(s.max()) for s in shares),
                "moe/load_min": min(float(s.min()) for s in shares),
                "moe/idle_experts": float(sum(int((c == 0).sum()) for c in layers))}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
