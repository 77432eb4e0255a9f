"""Expert parallelism (``parallel.ep`` > 1) for mixture-of-experts denoisers in DeepSeek-V3's layout
(HiDream-I1's ``MOEFeedForwardSwiGLU``: ``gate(x) -> (topk_idx [N, k], topk_weight [N, k], aux)`` over ``E``
routed ``experts`` (a ``ModuleList``) plus ``shared_experts`` every token passes through).

Layout (torchtitan's, ``torchtitan/distributed/expert_parallel.py``): EP ranks are data-parallel ranks, so
``ep`` divides ``dp_shard``; the ``ep`` consecutive ranks of an EP group each keep ``E / ep`` routed experts of
every MoE layer (rank r: experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``, the others replaced by
parameterless placeholders, so names stay global). A layer's forward on each rank:

1. routes its own tokens with the (replicated) gate;
2. sorts the ``N * k`` (token, expert) pairs by expert, exchanges the per-expert counts, and sends each
   pair's token to the rank holding its expert (``all_to_all_single`` with variable splits);
3. runs every local expert on the tokens it received (every local expert runs, on zero rows if none came:
   an FSDP2 unit must all-gather on every rank of its group);
4. sends the outputs back (the reverse all-to-all) and sums them weighted by the gate, as diffusers'
   training path does, then adds the shared expert.

Both exchanges are ``torch.distributed._functional_collectives.all_to_all_single_autograd``: backward
runs the reverse exchange, so a routed expert's gradient sums every rank's tokens. FSDP2 then shards each
layer's local experts as one unit over the ranks holding the same experts (``dp_shard / ep`` of them) and
divides their gradients by the whole data-parallel degree (``set_gradient_divide_factor``), so they equal
the mean over all samples as every other parameter's do (``fsdp.py``). The same dispatch runs with and
without gradients (rollouts too); one process uses diffusers' own forward.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

#: name of the mesh dimension the local experts are FSDP-sharded over (the ranks holding the same experts)
EXPERT_SHARD_DIM = "dp_shard_mod_ep"


class RemoteExpert(torch.nn.Module):
    """Stands in for a routed expert another EP rank holds (no parameters; never called)."""

    def __init__(self, index: int, rank: int):
        super().__init__()
        self.index, self.rank = index, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"routed expert {self.index} lives on EP rank {self.rank}; tokens reach it by all-to-all")


def local_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """The routed experts EP rank ``ep_rank`` of ``ep`` holds. ``ValueError`` naming ``parallel.ep`` when it
    does not divide ``num_experts``."""
    if num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the model's {num_experts} routed experts per layer")
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def dispatch(layer: torch.nn.Module, x: torch.Tensor, group: dist.ProcessGroup, ep: int,
             local: list[torch.nn.Module]) -> torch.Tensor:
    """The EP forward of one MoE ``layer`` (module notes) on this rank's ``x`` ``[..., D]``; returns the same
    shape and dtype: sum over its top-k experts of gate weight x expert(token), plus the shared expert."""
    shape, dtype = x.shape, x.dtype
    topk_idx, topk_weight, _ = layer.gate(x)
    tokens = x.reshape(-1, shape[-1])
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=ep * len(local)).view(ep, len(local))
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)  # [source rank, local expert] pairs arriving here
    send, recv = counts.sum(1).tolist(), incoming.sum(1).tolist()
    inbox = all_to_all_single_autograd(tokens[order // k], recv, send, group)
    expert_of = torch.arange(len(local), device=incoming.device).repeat(ep).repeat_interleave(incoming.flatten())
    by_expert = torch.argsort(expert_of, stable=True)
    chunks = inbox[by_expert].split(incoming.sum(0).tolist())
    outputs = torch.cat([expert(chunk).to(dtype) for expert, chunk in zip(local, chunks)])
    outbox = all_to_all_single_autograd(outputs[torch.argsort(by_expert)], send, recv, group)
    routed = outbox[torch.argsort(order)].view(-1, k, shape[-1])
    y = (routed * topk_weight.unsqueeze(-1)).sum(dim=1).view(shape).to(dtype)
    return y + layer.shared_experts(x)


def apply_expert_parallel(moe_layers: list[torch.nn.Module], ep_mesh) -> list[list[torch.nn.Module]]:
    """Keep this EP rank's routed experts of every layer in ``moe_layers`` (others become
    :class:`RemoteExpert`) and route the layer's forward through :func:`dispatch` over ``ep_mesh`` (1-D,
    the EP group). Returns each layer's local experts (the FSDP2 units ``fsdp.py`` shards). ``ValueError``
    naming ``parallel.ep`` when it does not divide a layer's expert count."""
    ep, ep_rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    units = []
    for layer in moe_layers:
        mine = local_range(len(layer.experts), ep, ep_rank)
        for i in range(len(layer.experts)):
            if i not in mine:
                layer.experts[i] = RemoteExpert(i, i // len(mine))
        local = [layer.experts[i] for i in mine]
        layer.forward = types.MethodType(lambda self, x, _l=local: dispatch(self, x, group, ep, _l), layer)
        units.append(local)
    return units
