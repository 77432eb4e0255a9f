"""The pretraining objective on one micro-batch, with rank-free per-sample randomness."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.flow import flow_matching_loss, interpolate
from pretrain.schedule import sample_training_sigmas
from pretrain.seeding import generator_for
from pretrain.guidance import drop_condition
from pretrain.text_encoder import PromptEmbeds


@dataclass
class FlowConfig:
    """Rectified-flow training: logit-normal sigmas (``logit_mean``, ``logit_std``) with ``shift``;
    ``cond_dropout``: probability of training a sample on the empty prompt (for CFG)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    cond_dropout: float = 0.1


def draw_training_noise(x0: torch.Tensor, seed: int, step: int, indices: list[int], cfg: FlowConfig,
                        stream: str = "train") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (noise ``[B, ...]``, sigma ``[B]``, drop ``[B]`` bool), sample i drawn from the
    generator (seed, stream, step, indices[i]) in that order, on CPU, then moved to x0's device."""
    gens = [generator_for(seed, stream, step, i) for i in indices]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
    sigma = sample_training_sigmas(gens, cfg.logit_mean, cfg.logit_std, cfg.shift)
    drop = torch.stack([torch.rand((), generator=g) < cfg.cond_dropout for g in gens])
    return noise.to(x0.device), sigma.to(x0.device), drop.to(x0.device)


def pretrain_loss(model, x0: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                  noise: torch.Tensor, sigma: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Mean rectified-flow loss (float32 scalar) of ``model(x_sigma, sigma, embeds) -> v`` on latents
    ``x0 [B, C, h, w]``; samples with ``drop`` use ``null_embeds`` (``[1, ...]``)."""
    x_t = interpolate(x0, noise, sigma)
    v = model(x_t, sigma, drop_condition(embeds, null_embeds, drop))
    return flow_matching_loss(v, x0, noise).mean()
