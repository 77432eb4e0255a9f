"""The SD3 sequence-parallel plan: Ulysses joint attention (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv 2309.14509), a drop-in for diffusers' ``JointAttnProcessor2_0``, plus the hooks that split the image
tokens after the patch embedding and gather them before the final unpatchify
(:func:`sd3_sequence_parallel`, installed by :meth:`SD3Adapter.sequence_parallel
<pretrain.models.sd3.model.SD3Adapter.sequence_parallel>`).

The model's forward still takes and returns **full** tensors on every rank of the group:

- inputs ``x [B, C, H, W]``, ``sigma``, text embeddings are the same full tensors on every SP rank
  (DESIGN.md: SP ranks draw one full-size noise tensor from the rank-free generators and slice it);
- a forward hook on ``transformer.pos_embed`` keeps this rank's contiguous chunk of the ``N`` image
  tokens ``[B, N/sp, C]``; the patch embedding is cheap and computed in full on each rank;
- a forward hook on ``transformer.proj_out`` all-gathers the tokens back to ``[B, N, p*p*C]`` with
  ``gather_replicated``: the caller's loss is then replicated on the group, and each rank back-propagates
  only its chunk, so gradients summed over the SP ranks equal the single-process ones.

diffusers 0.42 ships context parallelism (``ContextParallelConfig`` / ``enable_parallelism`` driven by
a model's ``_cp_plan``) for FLUX, Wan, LTX, Qwen-Image and others but not for
``SD3Transformer2DModel`` (no ``_cp_plan``; its ``JointAttnProcessor2_0`` calls
``F.scaled_dot_product_attention`` directly, not the dispatcher that CP hooks into), so SD3 uses this.

Layout on each of the ``sp`` ranks of a group: image tokens are split (rank ``r`` holds tokens
``[r N/sp, (r+1) N/sp)`` with all ``H`` heads); text tokens are **replicated** (every rank holds all
``L`` of them). Per attention call:

1. project the local image tokens to Q, K, V ``[B, N/sp, H, D]`` and all-to-all them to
   ``[B, N, H/sp, D]`` (all image tokens, heads ``[r H/sp, (r+1) H/sp)``);
2. project the (replicated) text tokens and keep the same head slice ``[B, L, H/sp, D]`` (no
   communication);
3. SDPA over the joint sequence ``[image (all N, in order); text]`` for those heads, exactly what
   ``JointAttnProcessor2_0`` computes for them;
4. all-to-all the image part back to ``[B, N/sp, H, D]``; all-gather the text part over heads to
   ``[B, L, H, D]`` so every rank again holds identical text tokens.

So the result equals SP = 1 up to float rounding. For gradients, every replicated text-stream tensor is
consumed on rank ``r`` only through heads of slice ``r`` (step 2), and the text all-gather's backward sums
over ranks; hence the per-rank parameter gradients summed over the SP group are the SP = 1 gradients
(FSDP2 sums them, see :mod:`pretrain.parallel.fsdp`). The alternative -- all-gathering image K/V so every rank attends
for all heads -- moves N x H x D per rank per layer instead of N x H x D / sp and is not used.

The SP degree must divide the head count and the image token count (``ValueError`` otherwise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.parallel.comm import all_gather, all_to_all, gather_replicated, split


class UlyssesJointAttnProcessor:
    """``attn.set_processor(UlyssesJointAttnProcessor(group))``: joint (image + text) attention with image
    tokens sequence-sharded over ``group``. Shapes: ``hidden_states [B, N/sp, C]``,
    ``encoder_hidden_states [B, L, C']`` (full, identical on the group) or None (image-only attention,
    e.g. SD3.5's ``attn2``). Returns what ``JointAttnProcessor2_0`` returns, for the local tokens."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def _heads(self, attn, x: torch.Tensor, proj, norm) -> torch.Tensor:
        batch, heads = x.shape[0], attn.heads
        out = proj(x)
        out = out.view(batch, -1, heads, out.shape[-1] // heads)
        return norm(out) if norm is not None else out  # RMSNorm over head_dim: same in any layout

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        sp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if attn.heads % sp:
            raise ValueError(f"sequence parallel: sp={sp} does not divide the attention head count {attn.heads}")
        per = attn.heads // sp
        q = self._heads(attn, hidden_states, attn.to_q, attn.norm_q)
        k = self._heads(attn, hidden_states, attn.to_k, attn.norm_k)
        v = self._heads(attn, hidden_states, attn.to_v, None)
        q, k, v = (all_to_all(t, 2, 1, self.group) for t in (q, k, v))  # [B, N, H/sp, D]
        n_image = q.shape[1]
        if encoder_hidden_states is not None:
            heads = slice(rank * per, (rank + 1) * per)
            tq = self._heads(attn, encoder_hidden_states, attn.add_q_proj, attn.norm_added_q)[:, :, heads]
            tk = self._heads(attn, encoder_hidden_states, attn.add_k_proj, attn.norm_added_k)[:, :, heads]
            tv = self._heads(attn, encoder_hidden_states, attn.add_v_proj, None)[:, :, heads]
            q, k, v = torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.0, is_causal=False).transpose(1, 2).to(q.dtype)
        image = all_to_all(out[:, :n_image], 1, 2, self.group).flatten(2)  # [B, N/sp, H*D]
        image = attn.to_out[1](attn.to_out[0](image))
        if encoder_hidden_states is None:
            return image
        text = all_gather(out[:, n_image:].contiguous(), 2, self.group).flatten(2)  # [B, L, H*D]
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return image, text


def sd3_sequence_parallel(transformer: torch.nn.Module, group) -> list:
    """Install the plan of the module docstring on ``transformer`` (an ``SD3Transformer2DModel``):
    :class:`UlyssesJointAttnProcessor` on every attention, the split / gather hooks; returns the hook
    handles. ``ValueError`` if the group size does not divide the head count (here) or the image token
    count (at the first forward)."""
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
