"""The UNet family's own pixel-space presets: a ``UNet2DConditionModel`` (Rombach et al. 2022, the SD 1.x
UNet, scaled down) predicting epsilon under a DDPM-type noise schedule over 1000 training steps,
cross-attending to the text encoder's token embeddings (the pooled embedding is not used).

The schedule is a diffusers ``DDIMScheduler`` config (``set_alpha_to_one``, no clipping, "leading"
spacing) that :class:`pretrain.models.unet.vp_schedule.VPSchedule` walks: the flow Euler sampler over
its sigmas is DDIM with eta = 0. Its betas are the cosine schedule (Nichol & Dhariwal 2021, arXiv
2102.09672, made for small pixel-space images), not DDPM's linear 1e-4 .. 0.02: DDIM's first step
(t = 950 of 20 "leading" steps) turns an epsilon error into an x0 error s / alpha times larger, 13 under
the cosine schedule and 97 under the linear one, and without x0 clipping (a clipped step is not an Euler
step) a model trained for minutes on a CPU samples noise under the linear schedule.
``model.overrides.scheduler`` (a mapping) patches the scheduler config; train the presets with
``flow.objective: epsilon`` (:mod:`pretrain.objective`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pretrain.models.config import ModelConfig

_DOWN, _CROSS_DOWN = "DownBlock2D", "CrossAttnDownBlock2D"
_UP, _CROSS_UP = "UpBlock2D", "CrossAttnUpBlock2D"

#: ``UNet2DConditionModel`` constructor fields per preset (sizes, channels and text width are set at build).
UNET_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1 M parameters: unit tests (16 or 32 px; one cross-attention level).
    "tiny": dict(block_out_channels=(8, 16), down_block_types=(_DOWN, _CROSS_DOWN), up_block_types=(_CROSS_UP, _UP),
                 layers_per_block=1, attention_head_dim=2, norm_num_groups=4),
    # ~4.9 M parameters: 32 px emoji, levels 32/16/8/4 px (channels 32/32/64/128), self- and cross-attention
    # at 8 and 4 px (4 heads; at 16 px it would double the step time on a CPU).
    "emoji": dict(block_out_channels=(32, 32, 64, 128), down_block_types=(_DOWN, _DOWN, _CROSS_DOWN, _CROSS_DOWN),
                  up_block_types=(_CROSS_UP, _CROSS_UP, _UP, _UP), layers_per_block=1, attention_head_dim=4,
                  norm_num_groups=8, time_embedding_dim=256),
}

#: The presets' noise schedule: the cosine schedule as a DDIM scheduler config that VPSchedule walks.
UNET_SCHEDULER: dict[str, Any] = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "squaredcos_cap_v2",
    "prediction_type": "epsilon", "set_alpha_to_one": True, "clip_sample": False, "thresholding": False,
    "timestep_spacing": "leading", "steps_offset": 0,
}


def _tuples(fields: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def build(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    """Build (or load from ``cfg.pretrained``) a ``UNet2DConditionModel`` (float32, random init from the
    global torch generator) for ``channels`` x ``sample_size`` x ``sample_size`` inputs (pixels, with the
    ``patchify`` codec) and text tokens of width ``text_dim`` (``pooled_dim`` is not used). Preset fields
    are patched by ``cfg.overrides`` (the ``scheduler`` key aside, see :func:`preset_settings`).
    Raises ``ValueError`` naming ``model.preset`` for an unknown preset, and ``data.size`` when the
    resolution halvings do not divide ``sample_size``."""
    from diffusers import UNet2DConditionModel

    if cfg.pretrained:
        return UNet2DConditionModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    if cfg.preset not in UNET_PRESETS:
        raise ValueError(f"model.preset: unknown preset '{cfg.preset}'; known: {sorted(UNET_PRESETS)}")
    kw = _tuples({**UNET_PRESETS[cfg.preset], **{k: v for k, v in cfg.overrides.items() if k != "scheduler"}})
    factor = 2 ** (len(kw["block_out_channels"]) - 1)
    if sample_size % factor:
        raise ValueError(f"data.size: sample size {sample_size} is not divisible by {factor} (the UNet halves the "
                         f"resolution {len(kw['block_out_channels']) - 1} times)")
    return UNet2DConditionModel(sample_size=sample_size, in_channels=channels, out_channels=channels,
                                cross_attention_dim=text_dim, **kw)


def preset_settings(cfg: ModelConfig) -> dict:
    """The adapter settings of a preset build: ``{"scheduler": UNET_SCHEDULER patched by
    cfg.overrides["scheduler"]}`` (what :meth:`UNetAdapter.from_settings` takes). Raises ``ValueError``
    naming ``model.overrides.scheduler`` when it is not a mapping or the patched config is not a
    scheduler :class:`VPSchedule` walks."""
    from pretrain.models.unet.adapter import scheduler_from_config
    from pretrain.models.unet.vp_schedule import VPSchedule

    patch = cfg.overrides.get("scheduler", {})
    if not isinstance(patch, dict):
        raise ValueError(f"model.overrides.scheduler: must be a mapping of scheduler config fields, got {patch!r}")
    config = {**UNET_SCHEDULER, **patch}
    try:
        VPSchedule(scheduler_from_config(config))
    except ValueError as e:
        raise ValueError(f"model.overrides.scheduler: {e}") from e
    return {"scheduler": config}
