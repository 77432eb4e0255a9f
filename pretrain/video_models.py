"""Video backbone presets: diffusers ``WanTransformer3DModel`` (Wan team 2025, arXiv 2503.20314) in
pixel space (with :class:`pretrain.codec.VideoPatchifyCodec`) and its adapter.

``WanTransformer3DModel`` predicts the flow velocity eps - x0 at timestep = sigma * 1000 (what
``WanPipeline`` passes) from video latents ``[B, C, F, h, w]`` and text states ``[B, L, text_dim]``;
it has no pooled text input.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.backbone import Backbone
from pretrain.text_encoder import PromptEmbeds

#: Self-attention (attn1) and text cross-attention (attn2) projections of every ``WanTransformerBlock``.
WAN_ATTENTION = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]

WAN_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2 M parameters: unit, distributed and integration tests.
    "tiny": dict(patch_size=[1, 2, 2], num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64,
                 freq_dim=32),
    # ~2 M parameters: the CPU video demo.
    "small": dict(patch_size=[1, 2, 2], num_layers=4, num_attention_heads=4, attention_head_dim=32, ffn_dim=384,
                  freq_dim=64),
}


class WanVideoAdapter(Backbone):
    """Wraps ``WanTransformer3DModel``: ``forward(x [B, C, F, h, w], sigma [B] in [0, 1], embeds) ->
    velocity`` float32 ``[B, C, F, h, w]``. The transformer gets ``x`` and ``embeds.tokens`` ``[B, L, D]``
    in its dtype and the float32 timestep sigma * ``timestep_scale``; ``embeds.pooled`` is unused.
    Sampling schedule: :func:`pretrain.schedule.sigma_schedule` (the family adapter of Wan pipeline
    folders overrides it with the folder's scheduler)."""

    lora_targets = WAN_ATTENTION
    timestep_scale = 1000.0

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        timestep = sigma.to(device=x.device, dtype=torch.float32) * self.timestep_scale
        out = self.transformer(hidden_states=x.to(dtype), timestep=timestep,
                               encoder_hidden_states=embeds.tokens.to(x.device, dtype), return_dict=False)[0]
        return out.float()


def build_wan_transformer(preset: str, overrides: dict, channels: int, text_dim: int):
    """A randomly initialised ``WanTransformer3DModel`` from ``WAN_PRESETS[preset]`` patched by
    ``overrides``, on latents with ``channels`` channels and text states of ``text_dim``. Raises
    ``ValueError`` for an unknown preset."""
    from diffusers import WanTransformer3DModel

    if preset not in WAN_PRESETS:
        raise ValueError(f"model.preset: unknown preset '{preset}' for arch wan; known: {sorted(WAN_PRESETS)}")
    kw = {**WAN_PRESETS[preset], **dict(overrides)}
    kw["patch_size"] = tuple(kw["patch_size"])
    return WanTransformer3DModel(in_channels=channels, out_channels=channels, text_dim=text_dim, **kw)
