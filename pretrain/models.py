"""Backbone presets and the SD3 model adapter.

A model adapter owns its architecture's sigma -> timestep convention: ``SD3Transformer2DModel``
takes timestep = sigma * 1000 (the SD3 pipeline passes the FlowMatchEulerDiscreteScheduler's
``timesteps = sigmas * num_train_timesteps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pretrain.backbone import Backbone
from pretrain.text_encoder import PromptEmbeds
from pretrain.video_models import WAN_PRESETS, WanVideoAdapter, build_wan_transformer

SD3_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                 "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]

# Pixel-space presets; joint/pooled dims come from the text encoder at build time.
SD3_PRESETS: dict[str, dict[str, Any]] = {
    # < 1 M parameters: unit and integration tests.
    "tiny": dict(patch_size=4, num_layers=2, num_attention_heads=2, attention_head_dim=32, caption_projection_dim=64),
    # ~5 M parameters: the CPU quickstart.
    "small": dict(patch_size=4, num_layers=4, num_attention_heads=3, attention_head_dim=64, caption_projection_dim=192),
}


@dataclass
class ModelConfig:
    """Backbone choice. ``arch``: "sd3" (``SD3Transformer2DModel``, images) or "wan"
    (``WanTransformer3DModel``, videos: :mod:`pretrain.video_models`); ``preset`` names an entry of
    that arch's presets (``ARCHES[arch].presets``); ``pretrained`` is a local diffusers
    folder (transformer weights) that overrides the preset; ``overrides`` patch preset fields.
    Post-training stages take ``pretrained`` = an export of this project or a diffusers pipeline folder
    of a known family (:mod:`pretrain.families`), loaded with ``options`` (e.g. ``image_size``,
    ``num_frames``, ``guidance``, ``max_sequence_length``: see the family's ``load``)."""

    arch: str = "sd3"
    preset: str = "tiny"
    pretrained: str | None = None
    subfolder: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


class SD3Adapter(Backbone):
    """Wraps ``SD3Transformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v``.

    The velocity is returned in float32 whatever the model dtype. The project's own presets use it
    with :func:`pretrain.schedule.sigma_schedule`; :mod:`pretrain.families.sd3` subclasses it for
    SD3/SD3.5 pipeline folders."""

    timestep_scale = 1000.0
    lora_targets = SD3_ATTENTION

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """SD3 convention: timestep = sigma * 1000."""
        return sigma * self.timestep_scale

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        out = self.transformer(
            hidden_states=x.to(dtype), encoder_hidden_states=embeds.tokens.to(dtype),
            pooled_projections=embeds.pooled.to(dtype), timestep=self.timestep(sigma.to(x.device)).to(dtype),
            return_dict=False,
        )[0]
        return out.float()


def build_transformer(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    """Build (or load from ``cfg.pretrained``) an ``SD3Transformer2DModel``.

    ``sample_size``: spatial size of the codec's output (pixels for ``PatchifyCodec``).
    Raises ``ValueError`` for an unknown preset or a size the patch does not divide."""
    from diffusers import SD3Transformer2DModel

    if cfg.pretrained:
        return SD3Transformer2DModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    if cfg.preset not in SD3_PRESETS:
        raise ValueError(f"model.preset: unknown preset '{cfg.preset}'; known: {sorted(SD3_PRESETS)}")
    kw = {**SD3_PRESETS[cfg.preset], **dict(cfg.overrides)}
    if sample_size % kw["patch_size"]:
        raise ValueError(f"model: sample size {sample_size} is not divisible by patch_size {kw['patch_size']}")
    return SD3Transformer2DModel(
        sample_size=sample_size, in_channels=channels, out_channels=channels, joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim, pos_embed_max_size=sample_size // kw["patch_size"], **kw,
    )


def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@dataclass(frozen=True)
class Arch:
    """One backbone architecture: its ``presets``, ``build(cfg, sample_size, channels, text_dim,
    pooled_dim) -> diffusers model``, the ``adapter`` class wrapping it and the diffusers class name
    exports are loaded with."""

    presets: dict[str, dict[str, Any]]
    build: Callable[..., torch.nn.Module]
    adapter: type[Backbone]
    diffusers_class: str


def _build_wan(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    from diffusers import WanTransformer3DModel

    if cfg.pretrained:
        return WanTransformer3DModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    return build_wan_transformer(cfg.preset, cfg.overrides, channels, text_dim)


ARCHES: dict[str, Arch] = {
    "sd3": Arch(SD3_PRESETS, build_transformer, SD3Adapter, "SD3Transformer2DModel"),
    "wan": Arch(WAN_PRESETS, _build_wan, WanVideoAdapter, "WanTransformer3DModel"),
}


def arch_of(name: str) -> Arch:
    """``ARCHES[name]``; ``ValueError`` naming ``model.arch`` otherwise."""
    if name not in ARCHES:
        raise ValueError(f"model.arch: unknown arch '{name}'; known: {sorted(ARCHES)}")
    return ARCHES[name]


def build_backbone(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int) -> Backbone:
    """The adapter of ``cfg.arch`` around a new (or ``cfg.pretrained``) denoiser; see :class:`Arch`."""
    arch = arch_of(cfg.arch)
    return arch.adapter(arch.build(cfg, sample_size, channels, text_dim, pooled_dim))

