"""The FLUX preset family: ``FluxTransformer2DModel`` (Black Forest Labs 2024; the MMDiT of Esser et al.
2024 with double-stream then single-stream blocks and 3-axis RoPE) presets for pixel-space pretraining on
the CPU, and their adapter.

A preset sees the codec's latents ``[B, C, h, w]`` (h, w even) as ``FluxPipeline`` does: packed into 2x2
patches, a sequence of (h/2)(w/2) tokens of 4C channels, with the pipeline's image ids for RoPE and zero
text ids. Unlike FLUX.1-dev it is not guidance-distilled (``guidance_embeds`` False): it is trained with
condition dropout and sampled with two-branch CFG, as the SD3 presets are, over
:func:`pretrain.schedule.sigma_schedule` (no dynamic shift). Timesteps follow FLUX: sigma, which the
transformer multiplies by 1000 itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pretrain.backbone import Backbone
from pretrain.models.flux.pipeline import FluxAdapter

if TYPE_CHECKING:
    from pretrain.models.config import ModelConfig

#: Pixel-space presets (``axes_dims_rope`` sums to ``attention_head_dim``); joint / pooled widths come
#: from the text encoder, channels from the codec (x4 for the 2x2 packing).
FLUX_PRESETS: dict[str, dict[str, Any]] = {
    # < 0.3 M parameters: unit and integration tests.
    "tiny": dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                 axes_dims_rope=(4, 6, 6)),
    # ~5 M parameters (2 double + 4 single blocks, hidden 192): the CPU preset (configs/pretrain/shapes_flux.yaml).
    "small": dict(num_layers=2, num_single_layers=4, num_attention_heads=3, attention_head_dim=64,
                  axes_dims_rope=(16, 24, 24)),
}


class FluxPresetAdapter(FluxAdapter):
    """:class:`pretrain.models.flux.pipeline.FluxAdapter` for a preset (no pipeline scheduler):
    ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v`` float32, timestep sigma (the FLUX
    convention: scheduler timestep / 1000, cast to the weights' dtype first), no embedded guidance;
    sampling schedule :func:`pretrain.schedule.sigma_schedule` with ``shift``. ``ValueError`` if the
    transformer embeds guidance (a guidance-distilled model is loaded from its pipeline folder instead)."""

    def __init__(self, transformer: torch.nn.Module):
        Backbone.__init__(self, transformer)
        if transformer.config.guidance_embeds:
            raise ValueError("model: a FLUX preset is trained with CFG; guidance_embeds must be false")
        self.scheduler_class, self.scheduler_config = None, {"num_train_timesteps": 1000}
        self.image_seq_len, self.guidance = 0, None

    sigmas = Backbone.sigmas


def build(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    """A randomly initialised float32 ``FluxTransformer2DModel`` from ``FLUX_PRESETS[cfg.preset]`` patched
    by ``cfg.overrides`` (or loaded from ``cfg.pretrained``), for codec latents of ``channels`` channels and
    side ``sample_size`` and text states of widths ``text_dim`` / ``pooled_dim``. Raises ``ValueError``
    for an unknown preset, an odd sample size, or RoPE axes that do not sum to the head width."""
    from diffusers import FluxTransformer2DModel

    if cfg.pretrained:
        return FluxTransformer2DModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    if cfg.preset not in FLUX_PRESETS:
        raise ValueError(f"model.preset: unknown preset '{cfg.preset}' for arch flux; known: {sorted(FLUX_PRESETS)}")
    kw = {**FLUX_PRESETS[cfg.preset], **dict(cfg.overrides)}
    if sample_size % 2:
        raise ValueError(f"model: sample size {sample_size} is odd; FLUX packs 2x2 latent patches")
    kw["axes_dims_rope"] = tuple(kw["axes_dims_rope"])
    if sum(kw["axes_dims_rope"]) != kw["attention_head_dim"]:
        raise ValueError(f"model.overrides.axes_dims_rope: {list(kw['axes_dims_rope'])} sums to "
                         f"{sum(kw['axes_dims_rope'])}, not attention_head_dim {kw['attention_head_dim']}")
    return FluxTransformer2DModel(in_channels=4 * channels, joint_attention_dim=text_dim,
                                  pooled_projection_dim=pooled_dim, guidance_embeds=False, **kw)
