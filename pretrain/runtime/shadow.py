"""A copy of a model's trainable weights, kept as each rank's shards, that can be swapped into the model.

Under FSDP2 / TP the parameters are DTensors and the copy holds this rank's local shard, so it costs one
shard per rank and no rank ever holds an unsharded copy; the swap writes the copy into the parameters in
place, so the sharded model runs its usual collectives with the copied weights, and writes the model's
own weights back afterwards. The EMA of the weights (:mod:`pretrain.runtime.ema`) and the old policy of
the forward-process losses (:mod:`posttrain.grpo.old_policy`) are such copies.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def local_data(p: torch.Tensor) -> torch.Tensor:
    """The plain local tensor that holds ``p``'s values on this rank (a DTensor's local shard; torchao's
    FP8 / MXFP8 wrappers' high-precision tensor), written in place by the swap."""
    from pretrain.runtime.low_precision import _high_precision

    local = p.to_local() if isinstance(p, DTensor) else p
    inner = _high_precision(local)
    return (local if inner is None else inner).detach()


class ShadowWeights:
    """A copy of ``model``'s trainable parameters (``requires_grad``) as this rank's local tensors (the
    shard under FSDP2 / TP), each of its parameter's local shape and dtype, that can be swapped into the
    model (:meth:`swapped`). Frozen parameters (a LoRA base) get no copy: with LoRA the copy is the
    adapter's size."""

    def __init__(self, model: torch.nn.Module):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: local_data(p).clone() for n, p in self.params.items()}
        self.fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def _reshard(self) -> None:
        """Drop any all-gathered weights FSDP2 still holds (its root keeps them after a forward), so the
        next forward gathers what the shards hold now."""
        for m in self.fsdp:
            m.reshard()

    @contextmanager
    @torch.no_grad()
    def swapped(self):
        """Within the block the model's trainable parameters hold the copy (in place, so FSDP2 gathers
        them as usual); the model's own weights are restored on exit, even after an error. Not for use
        between a forward with gradient and its backward (the swap writes the parameters in place)."""
        saved = {n: local_data(p).clone() for n, p in self.params.items()}
        self._reshard()
        for n, p in self.params.items():
            local_data(p).copy_(self.shadow[n])
        try:
            yield
        finally:
            self._reshard()
            for n, p in self.params.items():
                local_data(p).copy_(saved[n])

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, local copy)`` of every trainable parameter (for the finite-values check)."""
        return list(self.shadow.items())

    def as_param(self, name: str) -> torch.Tensor:
        """The copy of parameter ``name`` as its parameter is: a DTensor of the same mesh and placements
        (sharing the local tensor) for a DTensor parameter, else the plain tensor."""
        p = self.params[name]
        if isinstance(p, DTensor):
            return DTensor.from_local(self.shadow[name], p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return self.shadow[name]

    @torch.no_grad()
    def load_tensors(self, values: dict) -> None:
        """Copy ``{name: tensor or DTensor}`` (every trainable parameter's name) into the copy."""
        for n in self.shadow:
            value = values[n]
            self.shadow[n].copy_(value.to_local() if isinstance(value, DTensor) else value)
