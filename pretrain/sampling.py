"""Deterministic ODE sampling with CFG, and labelled PNG grids of images or videos (cells drawn by
:mod:`pretrain.grid`; videos also animated by :mod:`pretrain.animation`)."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.animation import save_animation
from pretrain.flow import euler_sample
from pretrain.grid import edit_cells, grid_image
from pretrain.guidance import guided_velocity
from pretrain.seeding import randn_per_sample
from pretrain.text_encoder import PromptEmbeds


def initial_noise(n: int, shape: tuple[int, ...], seed: int, step: int = 0, stream: str = "sample",
                  device="cpu") -> torch.Tensor:
    """Noise ``[n, *shape]`` float32 (``shape``: one sample's latent shape, e.g. ``[C, h, w]`` or
    ``[C, F, h, w]``); sample i drawn from (seed, stream, step, i), so a prompt's image does not depend
    on the batch it is sampled in."""
    return randn_per_sample(tuple(shape), seed, step, range(n), stream=stream, device=device)


@torch.no_grad()
def sample_latents(model, embeds: PromptEmbeds, null_embeds: PromptEmbeds, noise: torch.Tensor,
                   num_inference_steps: int = 20, guidance_scale: float = 4.0,
                   shift: float | None = 1.0) -> torch.Tensor:
    """Euler ODE over ``model.sigmas(num_inference_steps, shift)`` (from sigma = 1, or the family's
    first sigma, to 0; ``shift`` None: the model's own) with CFG against ``null_embeds`` (the empty
    prompt, ``[1, ...]``).

    ``model``: a :class:`pretrain.backbone.Backbone`. ``noise``: unit Gaussian ``[B, ...]``, scaled by
    ``model.initial_scale`` into the first state. One batched forward of 2B samples per step when
    ``guidance_scale != 1``. Returns latents like ``noise``."""
    sigmas = model.sigmas(num_inference_steps, shift)
    cond, null = embeds.to(noise.device), null_embeds.to(noise.device)
    x = noise * model.initial_scale(float(sigmas[0]))
    return euler_sample(lambda x, s: guided_velocity(model, x, s, cond, null, guidance_scale), x, sigmas)


def frame_strips(videos: torch.Tensor, max_frames: int = 4) -> torch.Tensor:
    """Videos ``[N, F, 3, H, W]`` -> images ``[N, 3, H, k * W]``: k = min(F, ``max_frames``) evenly
    spaced frames (first and last included) side by side, left to right in time."""
    idx = torch.linspace(0, videos.shape[1] - 1, min(videos.shape[1], max_frames)).round().long()
    v = videos[:, idx.to(videos.device)]
    n, k, c, h, w = v.shape
    return v.permute(0, 2, 3, 1, 4).reshape(n, c, h, k * w)


def save_grid(images: torch.Tensor, captions: list[str], path: str | Path, cols: int = 8, scale: int = 3,
              marks: list[bool | None] | None = None, sources: torch.Tensor | None = None) -> Path:
    """Write images float ``[N, 3, H, W]`` in [0, 1] as a PNG grid, each cell upscaled ``scale`` x
    (nearest) with its caption underneath. Videos ``[N, F, 3, H, W]``: each cell shows up to 4 of its
    frames side by side (:func:`frame_strips`), upscaled only while a frame stays <= 128 px; the whole
    clips also go to a GIF and an MP4 beside the PNG (:func:`pretrain.animation.save_animation`).
    ``marks``: pass / fail frames per image (:func:`pretrain.grid.grid_image`). ``sources``: the samples'
    conditioning images (float ``[>= N, 3, h, w]`` in [0, 1]), each shown beside its output under the
    instruction (:func:`pretrain.grid.edit_cells`). Returns the PNG's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images, captions, marks, span = edit_cells(images, captions, marks, sources)
    if images.ndim == 5:
        save_animation(images, captions, path.with_suffix(""), cols=cols, scale=scale, span=span)
        images, scale = frame_strips(images), max(1, min(scale, 128 // images.shape[-2]))
    grid_image(images, captions, cols, scale, marks, span).save(path)
    return path
