"""The Wan preset family: diffusers ``WanTransformer3DModel`` (Wan team 2025, arXiv 2503.20314) presets
in pixel space (with :class:`pretrain.codec.VideoPatchifyCodec`) and its adapter.

``WanTransformer3DModel`` predicts the flow velocity eps - x0 at timestep = sigma * 1000 (what
``WanPipeline`` passes) from video latents ``[B, C, F, h, w]`` and text states ``[B, L, text_dim]``;
it has no pooled text input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pretrain.backbone import Backbone
from pretrain.models.wan.tensor_parallel import WAN_TP_PLAN
from pretrain.text_encoder import PromptEmbeds

if TYPE_CHECKING:
    from pretrain.models.config import ModelConfig

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
    Sampling schedule: :func:`pretrain.schedule.sigma_schedule` (the adapter of Wan pipeline folders,
    :class:`pretrain.models.wan.pipeline.WanAdapter`, overrides it with the folder's scheduler). Blocks:
    ``blocks``; sequence parallel: Ulysses (:mod:`pretrain.models.wan.sequence_parallel`)."""

    lora_targets = WAN_ATTENTION
    timestep_scale = 1000.0
    block_attrs = ("blocks",)
    tp_plan = WAN_TP_PLAN

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """Wan convention: timestep = sigma * ``timestep_scale`` (1000), float32."""
        return sigma.to(dtype=torch.float32) * self.timestep_scale

    def transformer_timestep(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The ``timestep`` argument of the transformer for latents ``x`` at ``sigma`` ``[B]``: float32
        ``[B]``, :meth:`timestep` (pipeline adapters may expand it per token)."""
        return self.timestep(sigma)

    def transformer_input(self, x: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The transformer's ``hidden_states`` for latents ``x``: ``x`` (an image-to-video adapter
        concatenates the prompts' conditions)."""
        return x

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        # diffusers' dtype skips the float32-kept modules (``_keep_in_fp32_modules``: scale_shift_table, the
        # time embedder, norms), one of which is the first parameter: bf16 weights take bf16 inputs
        dtype = self.transformer.dtype
        timestep = self.transformer_timestep(x, sigma.to(device=x.device))
        out = self.transformer(hidden_states=self.transformer_input(x, embeds).to(dtype), timestep=timestep,
                               encoder_hidden_states=embeds.tokens.to(x.device, dtype), return_dict=False)[0]
        return out.float()

    def sequence_parallel(self, group) -> list:
        """The Wan Ulysses plan (:func:`pretrain.models.wan.sequence_parallel.wan_sequence_parallel`);
        returns the hook handles. ``ValueError`` if the group size does not divide the head count (here)
        or the video token count (at the first forward)."""
        from pretrain.models.wan.sequence_parallel import wan_sequence_parallel

        return wan_sequence_parallel(self.transformer, group)


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


def build(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    """The family's build function (:class:`pretrain.models.Family`): ``cfg.pretrained`` loaded
    (``from_pretrained``, ``cfg.subfolder``), else :func:`build_wan_transformer` of ``cfg.preset`` /
    ``cfg.overrides``. ``sample_size`` and ``pooled_dim`` are unused (Wan has no fixed size and no pooled
    text input). Raises ``ValueError`` for an unknown preset."""
    from diffusers import WanTransformer3DModel

    if cfg.pretrained:
        return WanTransformer3DModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    return build_wan_transformer(cfg.preset, cfg.overrides, channels, text_dim)
