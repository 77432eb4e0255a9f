"""The check every pipeline family's GRPO test makes of its export: the diffusers pipeline loading the
exported folder, and the source folder with the exported LoRA, both reproduce our sampler's images."""

from __future__ import annotations

import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents


def max_diff(a, b) -> float:
    """Max |a - b| over every element, as float32."""
    return (torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max().item()


def export_vs_pipeline(pipeline_cls, source, export, lora_dir, run, *, size: int, steps: int, scale: float,
                       prompt: str, options: dict | None = None) -> tuple[float, float, float]:
    """Max |difference| of our ODE images (``load_exported(export, options)``, ``steps`` steps, CFG
    ``scale``, seed 0) against ``run(pipe, noise)`` (the pipeline's images from our initial noise) for
    ``pipeline_cls.from_pretrained(export)``, for the ``source`` pipeline with ``load_lora_weights(lora_dir)``
    and for the bare ``source`` pipeline: ``(d_export, d_lora, d_base)``."""
    model, encoder, codec, _ = load_exported(export, options=options)
    noise = initial_noise(1, codec.latent_shape(size, size), 0)
    ours = codec.decode(sample_latents(model, encoder.encode([prompt]), encoder.encode([""]), noise, steps, scale,
                                       None))

    def diff(pipe) -> float:
        pipe.set_progress_bar_config(disable=True)
        return max_diff(run(pipe, noise), ours)

    with_lora = pipeline_cls.from_pretrained(source)
    with_lora.load_lora_weights(str(lora_dir))
    return diff(pipeline_cls.from_pretrained(export)), diff(with_lora), diff(pipeline_cls.from_pretrained(source))
