"""Loading a Qwen-Image pipeline folder: ``QwenImagePipeline`` (:mod:`pretrain.models.qwenimage.pipeline`) or
``QwenImageEditPipeline`` (:mod:`pretrain.models.qwenimage.edit`)."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.models.common import call_defaults, check_image_size, checked_options, family_meta, prompt_encoder_of
from pretrain.models.qwenimage import edit
from pretrain.models.qwenimage.pipeline import (COMPONENT, DTYPES, OPTIONS, PIPELINE, PIPELINES, QwenImageAdapter,
                                                QwenImageCodec, QwenImagePromptEncoder)


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a ``QwenImagePipeline`` folder: ``(QwenImageAdapter, QwenImagePromptEncoder, QwenImageCodec,
    meta)``; a ``QwenImageEditPipeline`` folder with the editing encoder and codec and an adapter that
    takes the source latents (:mod:`pretrain.models.qwenimage.edit`).

    ``options``: ``image_size`` (pixels; default the pipeline's 1024; a multiple of vae_scale_factor x 2),
    ``guidance_scale`` (true CFG, default the pipeline's 4.0), ``num_inference_steps`` (50),
    ``max_sequence_length`` (512), ``dtype`` ("float32", "bfloat16", "float16"; Qwen2.5-VL and the
    transformer load in it, the VAE stays float32), ``condition_area`` (Qwen-Image-Edit only: the pixels
    each source is resized to, default the pipeline's 1024 * 1024). Raises ``ValueError`` naming the key for an unknown
    option, a bad size or dtype."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    from pretrain.models.pipelines import pipeline_class

    path = Path(path)
    cls = pipeline_class(path) or PIPELINE
    if cls not in PIPELINES:
        raise ValueError(f"{path}: pipeline class '{cls}' is not a Qwen-Image pipeline (known: {list(PIPELINES)})")
    options, dtype = checked_options(options, OPTIONS, DTYPES, "Qwen-Image")
    area = int(options.get("condition_area", edit.CONDITION_AREA))
    if "condition_area" in options and (cls != edit.PIPELINE or area < 32 * 32):
        raise ValueError(f"model.options.condition_area: {options['condition_area']} is for Qwen-Image-Edit folders, "
                         f"at least 32 * 32 pixels (this folder: {cls})")
    defaults = call_defaults(QwenImagePipeline, "num_inference_steps", "max_sequence_length")
    defaults["guidance_scale"] = call_defaults(QwenImagePipeline, "true_cfg_scale")["true_cfg_scale"]
    vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    pipe = getattr(diffusers, cls).from_pretrained(str(path), vae=vae, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    factor = pipe.vae_scale_factor * 2
    size = check_image_size(int(options.get("image_size") or pipe.default_sample_size * pipe.vae_scale_factor), factor)
    model = QwenImageAdapter(pipe.transformer.eval(), pipe.scheduler, (size // factor) ** 2, cls == edit.PIPELINE)
    meta = family_meta("qwenimage", cls, COMPONENT, path, size, options, defaults)
    if cls == edit.PIPELINE:
        text_pipe = type(pipe)(scheduler=pipe.scheduler, vae=None, transformer=None, tokenizer=pipe.tokenizer,
                               processor=pipe.processor, text_encoder=pipe.text_encoder.eval().requires_grad_(False))
        length = int(options.get("max_sequence_length", defaults["max_sequence_length"]))
        encoder = edit.QwenImageEditPromptEncoder(text_pipe, path, length, dtype, device, area=area)
        return model, encoder, edit.QwenImageEditCodec(pipe.vae, area), meta
    encoder = prompt_encoder_of(QwenImagePromptEncoder, pipe, path, options, defaults, dtype, device)
    return model, encoder, QwenImageCodec(pipe.vae), meta
