"""The Wan sequence-parallel plan: Ulysses for ``WanTransformer3DModel`` (DeepSpeed-Ulysses, Jacobs et
al. 2023, arXiv 2309.14509) that runs on any backend, gloo on CPU included; installed by
:meth:`WanVideoAdapter.sequence_parallel <pretrain.models.wan.model.WanVideoAdapter.sequence_parallel>`.

diffusers 0.42 has a context-parallel plan for Wan (``enable_parallelism``), but it resolves its device
as ``rank % torch.accelerator.device_count()`` and so cannot run without an accelerator; this module
is the same layout, testable on CPU:

- the video tokens ``[B, N, C]`` are split after the patch embedding (a forward pre-hook on
  ``blocks[0]`` keeps rank ``r``'s contiguous chunk ``[B, N/sp, C]``), and the rotary tables
  ``(cos, sin) [1, N, 1, D]`` the same way (a forward hook on ``rope``);
- self-attention (``attn1``) projects, RMS-normalises (per token) and rotates the local tokens, then
  all-to-alls Q, K, V to ``[B, N, H/sp, D]`` (all tokens, a slice of the heads), attends, and
  all-to-alls back to ``[B, N/sp, H, D]``;
- cross-attention to the text (``attn2``), the feed-forward and the modulations are per token and need
  no communication (the text states and the timestep embedding stay replicated);
- a forward hook on ``proj_out`` gathers the tokens back to ``[B, N, C']`` (``gather_replicated``), so
  the model's output is the full tensor on every rank and each rank back-propagates only its chunk:
  gradients summed over the SP ranks (FSDP2 does) equal the single-process ones.

The SP degree must divide the head count and the token count (``ValueError`` otherwise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.parallel.comm import all_to_all, gather_replicated, split


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864) in Wan's interleaved layout: pairs
    ``(x[2i], x[2i+1])`` rotated by the angle whose cosine / sine are ``cos[..., 2i]`` / ``sin[..., 2i+1]``.
    ``x`` ``[B, N, H, D]``; ``cos``, ``sin`` ``[1, N, 1, D]``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class UlyssesWanSelfAttnProcessor:
    """Processor for a ``WanAttention`` self-attention (``attn1``) on sequence-sharded tokens
    ``hidden_states [B, N/sp, C]`` with the local rotary tables; returns ``[B, N/sp, C]``: what
    ``WanAttnProcessor`` computes for those tokens."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("UlyssesWanSelfAttnProcessor: self-attention only (no context, no mask)")
        sp = dist.get_world_size(self.group)
        if attn.heads % sp:
            raise ValueError(f"sequence parallel: sp={sp} does not divide the attention head count {attn.heads}")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        q, k, v = (all_to_all(t, 2, 1, self.group) for t in (q, k, v))  # [B, N, H/sp, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.0, is_causal=False).transpose(1, 2).type_as(q)
        out = all_to_all(out, 1, 2, self.group).flatten(2)  # [B, N/sp, H*D]
        return attn.to_out[1](attn.to_out[0](out))


def wan_sequence_parallel(transformer: torch.nn.Module, group) -> list:
    """Install the Ulysses processor on every block's ``attn1`` and the split / gather hooks of the
    module docstring on ``transformer`` (a ``WanTransformer3DModel``); returns the hook handles.
    ``ValueError`` if the group size does not divide the head count (here) or the token count (at the
    first forward)."""
    sp = dist.get_world_size(group)
    heads = transformer.config.num_attention_heads
    if heads % sp:
        raise ValueError(f"sequence parallel: sp={sp} does not divide num_attention_heads={heads}")
    for block in transformer.blocks:
        block.attn1.set_processor(UlyssesWanSelfAttnProcessor(group))

    def split_tokens_of(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % sp:
            raise ValueError(f"sequence parallel: sp={sp} does not divide the {x.shape[1]} video tokens")
        return split(x, 1, group)

    def split_rope(_module, _args, out):
        return tuple(split_tokens_of(t) for t in out)

    def split_tokens(_module, args, kwargs):
        x = split_tokens_of(args[0] if args else kwargs["hidden_states"])
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    return [transformer.rope.register_forward_hook(split_rope),
            transformer.blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True),
            transformer.proj_out.register_forward_hook(lambda _m, _a, out: gather_replicated(out, 1, group))]
