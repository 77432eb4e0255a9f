"""Z-Image pipeline folders (diffusers ``ZImagePipeline``; Tongyi-MAI 2025, arXiv 2511.22699): the
single-stream ``ZImageTransformer2DModel`` (noise and caption refiners, then joint layers), Qwen3 hidden
states (the second-to-last layer, each prompt at its own length) as text conditioning, a 16-channel
``AutoencoderKL`` with scaling and shift factors, and a ``FlowMatchEulerDiscreteScheduler``.

As the pipeline does:

- the transformer takes lists, one ``[C, 1, h, w]`` latent and one ``[L_i, D]`` caption per sample, and
  the timestep 1 - sigma (``(1000 - t) / 1000``); it predicts the negative velocity, which the adapter
  negates (our velocity is eps - x0);
- prompts go through ``encode_prompt`` (the chat template, the masked rows only); we pad them with zeros
  to ``max_sequence_length`` so prompts cache and batch alike, and the adapter gives each sample its
  rows back (the non-zero ones);
- the schedule walks ``torch.linspace(1, 1/n, n)`` through the scheduler with the resolution's mu.

Guidance. ``ZImagePipeline`` writes CFG as ``pos + w (pos - neg)``, which is the standard
``neg + (w + 1)(pos - neg)``: this project's ``guidance_scale`` (rollout, evaluation, the export's
recorded default) is the standard one, the pipeline's ``w`` plus 1, so 1 still means no unconditional
branch. Its optional ``cfg_normalization`` and ``cfg_truncation`` (off by default) are not modelled.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.backbone import Backbone
from pretrain.codec import VAECodec
from pretrain.models.common import (PipelinePromptEncoder, call_defaults, check_image_size, checked_options,
                                      family_meta, prompt_encoder_of, text_mask)
from pretrain.models.flow_schedule import dynamic_shift_sigmas
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
PIPELINE = "ZImagePipeline"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype")


def zimage_base_sigmas(n: int) -> list[float]:
    """``ZImagePipeline``'s unshifted sigmas: ``torch.linspace(1, 1/n, n)`` (float32) as a list."""
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    return get_default_z_image_sigmas(n)


class ZImageAdapter(Backbone):
    """Wraps ``ZImageTransformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v``
    float32 ``[B, C, h, w]``; ``embeds.tokens`` ``[B, L, D]`` zero-padded Qwen3 states, ``embeds.pooled``
    ``[B, 0]`` unused. ``image_seq_len`` sets the schedule's mu. Blocks: ``noise_refiner``,
    ``context_refiner``, ``layers``; LoRA on every attention's ``to_q/k/v/out``."""

    lora_targets = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
    block_attrs = ("noise_refiner", "context_refiner", "layers")

    def __init__(self, transformer: torch.nn.Module, scheduler, image_seq_len: int):
        super().__init__(transformer)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.image_seq_len = int(image_seq_len)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's schedule (:func:`pretrain.models.flow_schedule.dynamic_shift_sigmas` from
        :func:`zimage_base_sigmas`)."""
        return dynamic_shift_sigmas(self.scheduler_class, self.scheduler_config, self.image_seq_len,
                                    num_inference_steps, shift, base=zimage_base_sigmas)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """``(1000 - t) / 1000`` with t = sigma * ``num_train_timesteps`` (float32): 1 at the data end."""
        t = sigma.to(torch.float32) * self.scheduler_config.get("num_train_timesteps", 1000)
        return (1000 - t) / 1000

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype, device = next(self.transformer.parameters()).dtype, x.device
        tokens = embeds.tokens.to(device)
        captions = [row[keep].to(dtype) for row, keep in zip(tokens, text_mask(tokens))]
        out = self.transformer(list(x.to(dtype).unsqueeze(2).unbind(0)), self.timestep(sigma.to(device)), captions,
                               return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)


class ZImagePromptEncoder(PipelinePromptEncoder):
    """``ZImagePipeline.encode_prompt``: ``encode(prompts) -> PromptEmbeds(tokens [B, max_sequence_length,
    D], pooled [B, 0])`` float32 on the CPU, each prompt's rows then zeros. ``encode([""])`` is the
    pipeline's default negative prompt."""

    name = "zimage"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "zimage", path, max_sequence_length, dtype, device)
        self.dim = int(pipe.text_encoder.config.hidden_size)
        self.pooled_dim = 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                          max_sequence_length=self.max_sequence_length)
        tokens = rows[0].new_zeros(len(rows), self.max_sequence_length, rows[0].shape[-1])
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        return tokens, tokens.new_zeros(len(rows), 0)


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a ``ZImagePipeline`` folder: ``(ZImageAdapter, ZImagePromptEncoder, VAECodec, meta)``.

    ``options``: ``image_size`` (pixels; default 1024; a multiple of the VAE scale x 2),
    ``guidance_scale`` (the standard CFG scale: the pipeline's default 5.0 plus 1, see the module
    docstring), ``num_inference_steps`` (50), ``max_sequence_length`` (512), ``dtype`` ("float32",
    "bfloat16", "float16"; Qwen3 and the transformer load in it, the VAE stays float32). Raises
    ``ValueError`` naming the key for an unknown option, a bad size or dtype."""
    from diffusers import AutoencoderKL, ZImagePipeline

    path = Path(path)
    options, dtype = checked_options(options, OPTIONS, DTYPES, "Z-Image")
    defaults = call_defaults(ZImagePipeline, "num_inference_steps", "max_sequence_length", "guidance_scale")
    defaults["guidance_scale"] = float(defaults["guidance_scale"]) + 1.0
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    pipe = ZImagePipeline.from_pretrained(str(path), vae=vae, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    factor = pipe.vae_scale_factor * 2
    size = check_image_size(int(options.get("image_size") or 1024), factor)
    model = ZImageAdapter(pipe.transformer.eval(), pipe.scheduler, (size // factor) ** 2)
    encoder = prompt_encoder_of(ZImagePromptEncoder, pipe, path, options, defaults, dtype, device)
    meta = family_meta("zimage", PIPELINE, COMPONENT, path, size, options, defaults)
    return model, encoder, VAECodec(pipe.vae), meta
