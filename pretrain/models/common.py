"""Pieces the model families share: the joint-attention LoRA targets, option checks, the pipeline's call
defaults, the ``meta`` dict, the embedding-cache key of a pipeline folder and a prompt encoder that runs a
pipeline's own ``encode_prompt`` in batches."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import torch

from pretrain.text_encoder import PromptEmbeds

#: The projections of a joint (image + text) attention block of diffusers' SD3 and FLUX transformers:
#: image ``to_q/k/v/out`` and text ``add_q/k/v_proj`` / ``to_add_out`` (FLUX's single blocks have only
#: ``to_q/k/v``): their default LoRA targets.
JOINT_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                   "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


def folder_cache_key(family: str, path: str | Path, max_sequence_length: int, dtype: str) -> str:
    """A file-name-safe key unique per resolved folder, text length and dtype:
    ``<family>-<folder name>-<12 hex of sha1(resolved path)>-L<max_sequence_length>-<dtype>`` (datasets
    cache their prompt embeddings under it)."""
    resolved = Path(path).resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    return f"{family}-{resolved.name}-{digest}-L{max_sequence_length}-{dtype}"


class PipelinePromptEncoder:
    """Base of the families' text encoders: ``encode(prompts) -> PromptEmbeds`` (float32, CPU) in
    batches of ``batch_size`` through :meth:`encode_batch`, which a family implements with its pipeline's
    ``encode_prompt`` (``(tokens [b, L, D], pooled [b, P])``, any dtype and device). ``cache_key``: see
    :func:`folder_cache_key`; subclasses set ``dim`` and ``pooled_dim``."""

    name = "pipeline"

    def __init__(self, pipe, family: str, path: str | Path, max_sequence_length: int, dtype: str, device: str):
        self.pipe, self.max_sequence_length, self.device = pipe, int(max_sequence_length), device
        self.cache_key = folder_cache_key(family, path, self.max_sequence_length, dtype)

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 16) -> PromptEmbeds:
        out = []
        for i in range(0, len(prompts), batch_size):
            tokens, pooled = self.encode_batch(list(prompts[i:i + batch_size]))
            out.append(PromptEmbeds(tokens.float().cpu(), pooled.float().cpu()))
        return PromptEmbeds.cat(out)


def text_mask(tokens: torch.Tensor) -> torch.Tensor:
    """bool ``[B, L]``: the positions of ``tokens`` ``[B, L, D]`` that are not all zero. Families whose
    pipelines give each prompt its own length (Qwen-Image, Z-Image) pad them with zeros, and a text
    encoder's hidden state is never exactly zero, so this is the pipeline's mask."""
    return tokens.abs().amax(-1) > 0


def prompt_encoder_of(encoder_cls, pipe, path: str | Path, options: dict, defaults: dict, dtype: str, device: str):
    """``encoder_cls`` (a :class:`PipelinePromptEncoder` of a single-text-encoder pipeline: Qwen-Image,
    FLUX.2 [klein], Z-Image) over a pipeline of ``pipe``'s class holding only its scheduler, tokenizer and
    frozen text encoder, at ``options["max_sequence_length"]`` (else ``defaults``')."""
    text_pipe = type(pipe)(scheduler=pipe.scheduler, vae=None, transformer=None, tokenizer=pipe.tokenizer,
                           text_encoder=pipe.text_encoder.eval().requires_grad_(False))
    length = int(options.get("max_sequence_length", defaults["max_sequence_length"]))
    return encoder_cls(text_pipe, Path(path), length, dtype, device)


def call_defaults(pipeline_cls, *names: str) -> dict:
    """The defaults of ``pipeline_cls.__call__``'s parameters ``names`` (e.g. ``guidance_scale``,
    ``num_inference_steps``, ``max_sequence_length``), read from its signature."""
    params = inspect.signature(pipeline_cls.__call__).parameters
    return {k: params[k].default for k in names}


def checked_options(options: dict | None, known: tuple[str, ...], dtypes: dict, family: str) -> tuple[dict, str]:
    """``(options as a plain dict, options["dtype"] or "float32")``. Raises ``ValueError`` naming the
    key for an option not in ``known`` or a dtype not in ``dtypes``."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"model.options: unknown {unknown} for a {family} pipeline (known: {list(known)})")
    dtype = options.get("dtype", "float32")
    if dtype not in dtypes:
        raise ValueError(f"model.options.dtype: '{dtype}' is not one of {sorted(dtypes)}")
    return options, dtype


def check_image_size(image_size: int, multiple: int) -> int:
    """``image_size``; ``ValueError`` unless ``multiple`` (VAE scale x patch size) divides it."""
    if image_size % multiple:
        raise ValueError(f"model.options.image_size: {image_size} is not divisible by {multiple} "
                         f"(VAE scale x patch size)")
    return image_size


def family_meta(family: str, pipeline: str, component: str, path: str | Path, image_size: int, options: dict,
                defaults: dict) -> dict:
    """The ``meta`` dict a family's ``load`` returns (see :mod:`pretrain.models.pipelines`): sampling
    ``num_inference_steps`` / ``guidance_scale`` from ``options``, else ``defaults`` (the pipeline's);
    ``shift`` None (the scheduler's own)."""
    sampling = {"num_inference_steps": int(options.get("num_inference_steps", defaults["num_inference_steps"])),
                "guidance_scale": float(options.get("guidance_scale", defaults["guidance_scale"])), "shift": None}
    return {"family": family, "pipeline": pipeline, "component": component, "source": str(path),
            "image_size": int(image_size), "sampling": sampling, "options": options}


class SchedulerTimestep:
    """Mixin of the adapters whose denoiser takes the scheduler's timestep over 1000 (FLUX.1, FLUX.2,
    Qwen-Image): sigma * ``num_train_timesteps`` (float32), cast to the weights' dtype, divided by 1000,
    as their pipelines compute ``t.to(latents.dtype) / 1000``. Needs ``transformer`` and
    ``scheduler_config``."""

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """What :meth:`fed_timestep` gives the weights' dtype, returned as float32 (shape of ``sigma``)."""
        return self.fed_timestep(sigma, next(self.transformer.parameters()).dtype).float()

    def fed_timestep(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = sigma.to(torch.float32) * self.scheduler_config.get("num_train_timesteps", 1000)
        return t.to(dtype) / 1000
