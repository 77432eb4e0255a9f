"""Sequence parallelism around a transformer (SD3 here; Wan video in ``ulysses_wan.py``): split the image tokens after the patch embedding,
run Ulysses attention (``ulysses.py``), gather the tokens before the final unpatchify.

``enable_sequence_parallel(model, group)`` changes the model in place so that its forward still takes
and returns **full** tensors on every rank of ``group`` (an ``SD3Adapter``'s ``forward(x, sigma,
embeds) -> v`` is unchanged for its caller):

- inputs ``x [B, C, H, W]``, ``sigma``, text embeddings are the same full tensors on every SP rank
  (DESIGN.md: SP ranks draw one full-size noise tensor from the rank-free generators and slice it);
- a forward hook on ``transformer.pos_embed`` keeps this rank's contiguous chunk of the ``N`` image
  tokens ``[B, N/sp, C]``; the patch embedding is cheap and computed in full on each rank;
- text tokens and the timestep embedding stay replicated (see ``ulysses.py``);
- a forward hook on ``transformer.proj_out`` all-gathers the tokens back to ``[B, N, p*p*C]`` with
  ``gather_replicated``: the caller's loss is then replicated on the group, and each rank back-propagates
  only its chunk, so gradients summed over the SP ranks equal the single-process ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.parallel.comm import gather_replicated, split
from pretrain.parallel.ulysses import UlyssesJointAttnProcessor
from pretrain.parallel.ulysses_wan import wan_sequence_parallel


class SequenceParallelHandle:
    """Undo ``enable_sequence_parallel``: ``remove()`` drops the hooks and restores the processors."""

    def __init__(self, transformer, processors, hooks):
        self.transformer, self.processors, self.hooks = transformer, processors, hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.transformer.set_attn_processor(self.processors)


def enable_sequence_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> SequenceParallelHandle:
    """Shard ``model``'s (an adapter or its diffusers transformer) tokens over ``group``: the plan of
    ``SEQUENCE_PLANS`` for its transformer class (SD3: this module; Wan video:
    :mod:`pretrain.parallel.ulysses_wan`).

    Raises ``ValueError`` for a transformer class without a plan, or if the group size does not divide
    the attention head count (here, up front) or the token count (at the first forward). Apply before
    or after ``fully_shard``."""
    transformer = getattr(model, "transformer", model)
    name = type(transformer).__name__
    if name not in SEQUENCE_PLANS:
        raise ValueError(f"sequence parallel: no plan for {name} (known: {sorted(SEQUENCE_PLANS)})")
    processors = transformer.attn_processors
    return SequenceParallelHandle(transformer, processors, SEQUENCE_PLANS[name](transformer, group))


def sd3_sequence_parallel(transformer: torch.nn.Module, group) -> list:
    """Install the SD3 plan of the module docstring on ``transformer``; returns the hook handles."""
    sp = dist.get_world_size(group)
    heads = transformer.config.num_attention_heads
    if heads % sp:
        raise ValueError(f"sequence parallel: sp={sp} does not divide num_attention_heads={heads}")

    def split_tokens(_module, _args, out):
        if out.shape[1] % sp:
            raise ValueError(f"sequence parallel: sp={sp} does not divide the {out.shape[1]} image tokens")
        return split(out, 1, group)

    def gather_tokens(_module, _args, out):
        return gather_replicated(out, 1, group)

    transformer.set_attn_processor(UlyssesJointAttnProcessor(group))
    return [transformer.pos_embed.register_forward_hook(split_tokens),
            transformer.proj_out.register_forward_hook(gather_tokens)]


SEQUENCE_PLANS = {"SD3Transformer2DModel": sd3_sequence_parallel, "WanTransformer3DModel": wan_sequence_parallel}
