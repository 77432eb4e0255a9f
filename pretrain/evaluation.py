"""Evaluation helpers shared by every trainer: the held-out flow-matching loss and sample grids."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain import objective
from pretrain.data.dataset import EncodedSet
from pretrain.objective import FlowConfig, draw_training_noise, objective_sigmas
from pretrain.codec import decode_conditions
from pretrain.sampling import initial_noise, sample_latents, save_grid


@torch.no_grad()
def heldout_loss(model, codec, data: EncodedSet, null, flow: FlowConfig, *, seed: int, num_samples: int, device,
                 batch: int = 64) -> float:
    """Mean loss of ``flow.objective`` (:mod:`pretrain.objective`) over the first ``num_samples`` held-out
    samples with fixed draws (stream "eval", step 0), so values are comparable across steps, runs and
    models (also the guard metric of post-training evaluation: reward hacking shows up as a rising
    held-out loss). Raises ``ValueError`` naming ``flow.objective`` for a discrete objective on a model
    without training timesteps."""
    n = min(num_samples, len(data))
    table = objective_sigmas(model, flow)
    total = 0.0
    for start in range(0, n, batch):
        idx = list(range(start, min(n, start + batch)))
        images, embeds, _ = data.batch(idx)
        x0 = codec.encode(images.to(device))
        noise, sigma, _ = draw_training_noise(x0, seed, 0, idx, flow, stream="eval", train_sigmas=table)
        no_drop = torch.zeros(len(idx), dtype=torch.bool, device=device)
        loss = objective.pretrain_loss(model, x0, embeds.to(device), null, noise, sigma, no_drop, flow.objective)
        total += loss.item() * len(idx)
    return total / n


def spread_indices(n_items: int, n: int) -> list[int]:
    """Up to ``n`` indices evenly spaced over ``range(n_items)``."""
    return sorted({round(i * (n_items - 1) / max(1, n - 1)) for i in range(min(n, n_items))})


@torch.no_grad()
def write_grid(model, codec, data: EncodedSet, null, *, num_prompts: int, seed: int, num_inference_steps: int,
               guidance_scale: float, shift: float | None, device, path: Path) -> Path:
    """ODE-sample ``num_prompts`` prompts evenly spaced over ``data`` (sorted by code point, so flags
    and faces both appear) with fixed per-prompt seeds; write a labelled PNG grid (an editing set's
    samples each beside its source image)."""
    idx = spread_indices(len(data), num_prompts)
    images, embeds, captions = data.batch(idx)
    noise = initial_noise(len(idx), codec.latent_shape(*images.shape[-2:]), seed, device=device)
    latents = sample_latents(model, embeds.to(device), null, noise, num_inference_steps, guidance_scale, shift)
    conditions = getattr(embeds, "images", None)
    sources = None if conditions is None else decode_conditions(codec, conditions.to(device))
    return save_grid(codec.decode(latents), captions, path, sources=sources)
