"""Stable Diffusion 3 / 3.5 pipeline folders (diffusers ``StableDiffusion3Pipeline``, Esser et al. 2024,
arXiv 2403.03206).

The denoiser is ``SD3Transformer2DModel`` (timestep = sigma * ``num_train_timesteps``, i.e. 1000); the
schedule is the folder's ``FlowMatchEulerDiscreteScheduler`` (as the pipeline walks it, or shifted once:
``model.options.schedule``, :mod:`pretrain.models.flow_schedule`); prompts go through the pipeline's own
``encode_prompt`` (two CLIP text encoders with projection + T5); latents through the 16-channel
``AutoencoderKL`` with its scaling and shift factors (:class:`pretrain.codec.VAECodec`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.codec import VAECodec
from pretrain.models.common import (PipelinePromptEncoder, call_defaults, check_image_size, checked_options,
                                      family_meta)
from pretrain.models.flow_schedule import checked_schedule, set_flow_timesteps
from pretrain.models.sd3.model import SD3Adapter

COMPONENT = "transformer"
PIPELINE = "StableDiffusion3Pipeline"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype", "schedule")


class SD3PipelineAdapter(SD3Adapter):
    """:class:`pretrain.models.sd3.model.SD3Adapter` walking the pipeline scheduler's sigmas.

    ``forward(x [B, 16, h, w], sigma [B] in [0, 1], embeds) -> velocity`` float32 (the transformer's
    prediction as is: SD3 is trained on v = eps - x0). ``image_seq_len``: image tokens per sample,
    used for the scheduler's ``mu`` when it shifts dynamically (as the pipeline computes it).
    ``schedule``: "pipeline" or "single_shift" (:mod:`pretrain.models.flow_schedule`)."""

    def __init__(self, transformer: torch.nn.Module, scheduler, image_seq_len: int, schedule: str = "pipeline"):
        super().__init__(transformer)
        self.scheduler_class = type(scheduler)
        self.scheduler_config = dict(scheduler.config)
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.image_seq_len = image_seq_len
        self.schedule = checked_schedule({"schedule": schedule})

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The sigmas ``StableDiffusion3Pipeline`` walks for ``num_inference_steps`` (its
        ``retrieve_timesteps`` -> ``scheduler.set_timesteps``), final 0 included: float32
        ``[num_inference_steps + 1]``, CPU; with ``schedule`` "single_shift" the schedule shifted once
        (what the pipeline walks when passed ``sigmas=linspace(1, 1/1000, n)``; diffusers#13243).
        ``shift`` not None replaces the scheduler's ``shift`` (and turns dynamic shifting off), as a
        scheduler made with ``from_config(config, shift=shift)`` walks. Raises ``ValueError`` if
        ``num_inference_steps`` < 1."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        cfg = dict(self.scheduler_config)
        if shift is not None:
            cfg.update(shift=float(shift), use_dynamic_shifting=False)
        scheduler = self.scheduler_class.from_config(cfg)
        mu = None
        if cfg.get("use_dynamic_shifting"):
            mu = calculate_shift(self.image_seq_len, cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.16))
        set_flow_timesteps(scheduler, num_inference_steps, self.schedule, mu)
        return scheduler.sigmas.to(torch.float32).clone()


class SD3PromptEncoder(PipelinePromptEncoder):
    """Prompts -> ``PromptEmbeds`` exactly as ``StableDiffusion3Pipeline.encode_prompt`` builds them:
    tokens float32 ``[B, 77 + max_sequence_length, D]`` (the two CLIP penultimate hidden states
    concatenated, zero-padded to the T5 width D, then the T5 states), pooled float32 ``[B, P]`` (the
    two CLIP projections concatenated; 4096 / 2048 for real SD3). ``encode([""])`` is the pipeline's
    unconditional embedding when no negative prompt is given. Outputs are on the CPU; ``cache_key`` is
    unique per resolved folder, T5 length and dtype."""

    name = "sd3"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "sd3", path, max_sequence_length, dtype, device)
        self.dim = int(pipe.transformer.config.joint_attention_dim)
        self.pooled_dim = int(pipe.transformer.config.pooled_projection_dim)

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return tokens, pooled


def load(path: Path, device: str, options: dict):
    """Load a ``StableDiffusion3Pipeline`` folder: ``(model, encoder, codec, meta)``.

    ``options``: ``image_size`` (pixels; default transformer ``sample_size`` x VAE scale, 1024 for
    SD3.5), ``guidance_scale`` / ``num_inference_steps`` / ``max_sequence_length`` (defaults: the
    pipeline's ``__call__`` defaults, 7.0 / 28 / 256), ``dtype`` ("float32" or "bfloat16"),
    ``schedule`` ("pipeline", the default: the sigmas the pipeline walks; "single_shift": shifted once,
    :mod:`pretrain.models.flow_schedule`). Raises ``ValueError`` naming the key for an unknown option,
    dtype or schedule, or an image size the VAE scale x patch size does not divide."""
    from diffusers import StableDiffusion3Pipeline

    options, dtype = checked_options(options, OPTIONS, DTYPES, "StableDiffusion3")
    schedule = checked_schedule(options)
    defaults = call_defaults(StableDiffusion3Pipeline, "guidance_scale", "num_inference_steps", "max_sequence_length")
    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    cfg = pipe.transformer.config
    multiple = pipe.vae_scale_factor * cfg.patch_size
    image_size = check_image_size(int(options.get("image_size") or cfg.sample_size * pipe.vae_scale_factor), multiple)
    model = SD3PipelineAdapter(pipe.transformer.eval(), pipe.scheduler, (image_size // multiple) ** 2, schedule)
    max_len = int(options.get("max_sequence_length", defaults["max_sequence_length"]))
    encoder = SD3PromptEncoder(pipe, path, max_len, dtype, device)
    meta = family_meta("sd3", PIPELINE, COMPONENT, path, image_size, options, defaults)
    return model, encoder, VAECodec(pipe.vae), meta
