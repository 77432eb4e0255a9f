"""The one sigma-schedule function and the training-time sigma sampler built on it.

Convention: sigma in [0, 1], sigma = 1 is pure noise; x_sigma = (1 - sigma) x0 + sigma eps.
Sampler, trainer and evaluator all call :func:`sigma_schedule`; a trajectory stores the schedule it
used and is never re-derived differently.
"""

from __future__ import annotations

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Timestep shift of SD3 (Esser et al. 2024, arXiv 2403.03206, eq. 23):
    sigma' = shift * sigma / (1 + (shift - 1) * sigma). Maps [0, 1] onto [0, 1], keeps 0 and 1 fixed;
    shift > 1 moves mass toward noise. Raises ``ValueError`` for shift <= 0."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_inference_steps: int, shift: float = 1.0) -> torch.Tensor:
    """Sampling schedule: float32 ``[num_inference_steps + 1]`` from 1 down to 0 (last entry exactly 0),
    linear in the unshifted sigma, then :func:`shift_sigmas`. Raises ``ValueError`` if steps < 1."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    base = torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float64)
    return shift_sigmas(base, shift).to(torch.float32)


def sample_training_sigmas(
    generators: list[torch.Generator], logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 1.0
) -> torch.Tensor:
    """Logit-normal training sigmas (SD3 paper, sec. 3.1, "lognorm(m, s)"), then the same shift as
    :func:`sigma_schedule`. One draw per generator; float32 ``[B]`` in (0, 1)."""
    u = torch.stack([torch.randn((), generator=g) for g in generators]) * logit_std + logit_mean
    return shift_sigmas(torch.sigmoid(u.double()), shift).to(torch.float32)


def sample_discrete_training_sigmas(generators: list[torch.Generator], train_sigmas: torch.Tensor) -> torch.Tensor:
    """DDPM's training timesteps (Ho et al. 2020, arXiv 2006.11239, Algorithm 1: t ~ Uniform({1, ..., T})):
    one index t uniform over ``range(T)`` per generator (``torch.randint``), returned as the flow sigmas
    ``train_sigmas[t]``, float32 ``[B]``. ``train_sigmas``: ``[T]``, the flow sigma of each training
    timestep (:meth:`pretrain.backbone.Backbone.train_sigmas`). Raises ``ValueError`` if it is empty."""
    if train_sigmas.ndim != 1 or len(train_sigmas) < 1:
        raise ValueError(f"train_sigmas must be a non-empty 1-D table, got shape {tuple(train_sigmas.shape)}")
    t = torch.stack([torch.randint(len(train_sigmas), (), generator=g) for g in generators])
    return train_sigmas.detach().cpu()[t].to(torch.float32)
