"""Sequence parallelism (Ulysses) around a model adapter: the adapter's own plan
(:meth:`pretrain.backbone.Backbone.sequence_parallel`, e.g. ``pretrain/models/sd3/sequence_parallel.py``)
splits the tokens after the patch embedding, runs Ulysses attention with the collectives of ``comm.py``
and gathers the tokens before the final unpatchify. This module installs and removes a plan; it knows no
model.

``enable_sequence_parallel(model, group)`` changes the model in place so that its forward still takes
and returns **full** tensors on every rank of ``group`` (the adapter's ``forward(x, sigma, embeds) -> v``
is unchanged for its caller); text tokens and the timestep embedding stay replicated; the output is
gathered with ``gather_replicated``, so gradients summed over the SP ranks (FSDP2 does, ``fsdp.py``)
equal the single-process ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SequenceParallelHandle:
    """Undo ``enable_sequence_parallel``: ``remove()`` drops the hooks and restores the processors."""

    def __init__(self, transformer, processors, hooks):
        self.transformer, self.processors, self.hooks = transformer, processors, hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        if self.processors is not None:
            self.transformer.set_attn_processor(self.processors)


def enable_sequence_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> SequenceParallelHandle:
    """Shard ``model``'s tokens over ``group`` with its plan: ``model.sequence_parallel(group)``
    (``model``: a :class:`pretrain.backbone.Backbone` adapter, whose ``.transformer`` is the denoiser).

    Raises ``ValueError`` naming the class for a model without a plan (not an adapter, or a family that
    has none), or if the group size does not divide the attention head count (up front) or the token
    count (at the first forward). Apply before or after ``fully_shard``."""
    plan = getattr(model, "sequence_parallel", None)
    if plan is None:
        raise ValueError(f"sequence parallel: {type(model).__name__} is not a model adapter (no "
                         f"sequence_parallel plan)")
    transformer = model.transformer
    processors = getattr(transformer, "attn_processors", None)
    return SequenceParallelHandle(transformer, processors, plan(group))
