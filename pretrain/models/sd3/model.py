"""The SD3 preset family: ``SD3Transformer2DModel`` (Esser et al. 2024, arXiv 2403.03206) presets for
pixel-space pretraining and the adapter around it.

The adapter owns its architecture's sigma -> timestep convention: ``SD3Transformer2DModel`` takes
timestep = sigma * 1000 (the SD3 pipeline passes the FlowMatchEulerDiscreteScheduler's
``timesteps = sigmas * num_train_timesteps``), in float32 whatever the weights' dtype, as the pipeline
passes them: the transformer's time embedding casts to its dtype only after the sinusoid, so a bf16
cast before it would feed 960.129 as 960 and 602.151 as 604.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pretrain.backbone import Backbone, ConditioningError
from pretrain.models.common import JOINT_ATTENTION
from pretrain.models.sd3.tensor_parallel import SD3_TP_PLAN
from pretrain.text_encoder import PromptEmbeds

if TYPE_CHECKING:
    from pretrain.models.config import ModelConfig

#: LoRA targets: the joint attention's image and text projections.
SD3_ATTENTION = JOINT_ATTENTION

# Pixel-space presets; joint/pooled dims come from the text encoder at build time.
SD3_PRESETS: dict[str, dict[str, Any]] = {
    # < 1 M parameters: unit and integration tests.
    "tiny": dict(patch_size=4, num_layers=2, num_attention_heads=2, attention_head_dim=32, caption_projection_dim=64),
    # ~5 M parameters: the CPU quickstart.
    "small": dict(patch_size=4, num_layers=4, num_attention_heads=3, attention_head_dim=64, caption_projection_dim=192),
    # ~14 M parameters, 4x the small preset's image tokens (patch 2): the GPU quickstart (configs/quickstart_gpu.yaml).
    "base": dict(patch_size=2, num_layers=6, num_attention_heads=4, attention_head_dim=64, caption_projection_dim=256),
}


class SD3Adapter(Backbone):
    """Wraps ``SD3Transformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v``.

    The velocity is returned in float32 whatever the model dtype. The project's own presets use it
    with :func:`pretrain.schedule.sigma_schedule`; :class:`pretrain.models.sd3.pipeline.SD3PipelineAdapter`
    subclasses it for SD3/SD3.5 pipeline folders. Blocks: ``transformer_blocks``; sequence parallel:
    Ulysses (:mod:`pretrain.models.sd3.sequence_parallel`)."""

    timestep_scale = 1000.0
    lora_targets = SD3_ATTENTION
    block_attrs = ("transformer_blocks",)
    tp_plan = SD3_TP_PLAN

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """SD3 convention: timestep = sigma * 1000, float32 (shape of ``sigma``), what the transformer
        receives whatever its dtype (as ``StableDiffusion3Pipeline``)."""
        return sigma.to(torch.float32) * self.timestep_scale

    takes_images = True

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The velocity float32 ``[B, C, h, w]``. Prompts with conditioning images (``embeds.images``
        ``[B, C_c, h, w]``) are read InstructPix2Pix's way (Brooks et al. 2023): the latents
        concatenated on channels, for a transformer built with ``in_channels`` = C + C_c
        (``model.overrides.in_channels``) and ``out_channels`` = C. ``ConditioningError`` (a ``ValueError``)
        when the channels do not add up."""
        dtype = next(self.transformer.parameters()).dtype
        want = self.transformer.config.in_channels
        if embeds.images is not None:
            if embeds.images.shape[0] != x.shape[0] or embeds.images.shape[2:] != x.shape[2:]:
                raise ConditioningError(f"SD3Adapter: conditioning images {tuple(embeds.images.shape)} do not match the "
                                 f"latents {tuple(x.shape)} in batch and size")
            x = torch.cat([x, embeds.images.to(x.dtype)], 1)
        if x.shape[1] != want:
            raise ConditioningError(f"SD3Adapter: the transformer takes {want} input channels, got {x.shape[1]} (latents"
                             f"{' + conditioning images' if embeds.images is not None else ''}; an editing model "
                             f"needs model.overrides.in_channels = latent + image channels, and its prompts images)")
        out = self.transformer(
            hidden_states=x.to(dtype), encoder_hidden_states=embeds.tokens.to(dtype),
            pooled_projections=embeds.pooled.to(dtype), timestep=self.timestep(sigma.to(x.device)),
            return_dict=False,
        )[0]
        return out.float()

    def sequence_parallel(self, group) -> list:
        """The SD3 Ulysses plan (:func:`pretrain.models.sd3.sequence_parallel.sd3_sequence_parallel`);
        returns the hook handles. ``ValueError`` if the group size does not divide the head count (here)
        or the image token count (at the first forward)."""
        from pretrain.models.sd3.sequence_parallel import sd3_sequence_parallel

        return sd3_sequence_parallel(self.transformer, group)


def build_transformer(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int):
    """Build (or load from ``cfg.pretrained``) an ``SD3Transformer2DModel`` (float32, random init from
    the global torch generator).

    ``sample_size``: spatial size of the codec's output (pixels for ``PatchifyCodec``); ``channels``:
    its channel count; ``text_dim`` / ``pooled_dim``: the text encoder's token and pooled widths.
    Raises ``ValueError`` for an unknown preset or a size the patch does not divide."""
    from diffusers import SD3Transformer2DModel

    if cfg.pretrained:
        return SD3Transformer2DModel.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder)
    if cfg.preset not in SD3_PRESETS:
        raise ValueError(f"model.preset: unknown preset '{cfg.preset}'; known: {sorted(SD3_PRESETS)}")
    kw = {**SD3_PRESETS[cfg.preset], **dict(cfg.overrides)}
    if sample_size % kw["patch_size"]:
        raise ValueError(f"model: sample size {sample_size} is not divisible by patch_size {kw['patch_size']}")
    kw = {"in_channels": channels, "out_channels": channels, **kw}  # an editing model: in_channels overridden
    return SD3Transformer2DModel(
        sample_size=sample_size, joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim, pos_embed_max_size=sample_size // kw["patch_size"], **kw,
    )
