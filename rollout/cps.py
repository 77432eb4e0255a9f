"""Coefficients-Preserving Sampling (CPS; Wang et al. 2025, arXiv 2509.05952, eq. 9-10): a stochastic
flow step whose noise keeps the coefficients of x0 and of the noise what the schedule says at the
next sigma, so it adds no excess noise (the Flow-GRPO SDE does at large steps).

With x0_hat = x - sigma v and x1_hat = x + (1 - sigma) v (the predicted clean sample and noise) and
s = sigma_next * sin(noise_level * pi / 2):

    mean   = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) x1_hat
    x_next = mean + s z,   z ~ N(0, I)

Its log-prob is the full Gaussian log-density of x_next under N(mean, s^2), normaliser and log-std
included, averaged over non-batch elements like the SDE's (one public port drops the normaliser,
which rescales the ratio). The KL to the reference uses the same s. With noise_level = 0 the step is
the Euler step x + (sigma_next - sigma) v; at sigma_next = 0 it is deterministic (log-prob 0).
"""

from __future__ import annotations

import math

import torch

from rollout.sde import SDEStep, batch_sigmas, gaussian_transition, per_sample


def preserving_transition(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                          std: torch.Tensor, *, noise: torch.Tensor | None, prev_sample: torch.Tensor | None,
                          name: str) -> SDEStep:
    """The Gaussian transition N(mean, std^2) with mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2)
    x1_hat (x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v): the next state keeps the schedule's
    coefficient 1 - sigma_next on x0 and total noise sigma_next (CPS and DDIM differ only in ``std``).
    ``x``, ``velocity`` ``[B, ...]`` (math in float32); ``sigma``, ``sigma_next``, ``std`` float32 ``[B]``
    with 0 <= std <= sigma_next. Result as :func:`rollout.sde.sde_step`, ``std_dev_t`` = ``step_std`` =
    ``std``; ``ValueError`` naming ``name`` without ``noise`` or ``prev_sample`` while std > 0."""
    x32, v32 = x.float(), velocity.float()
    s, sn = per_sample(sigma, x32), per_sample(sigma_next, x32)
    x0_hat, x1_hat = x32 - s * v32, x32 + (1 - s) * v32
    mean = (1 - sn) * x0_hat + per_sample(torch.sqrt((sigma_next ** 2 - std ** 2).clamp(min=0.0)), x32) * x1_hat
    prev_sample, log_prob = gaussian_transition(mean, std, noise, prev_sample, name)
    return SDEStep(prev_sample, log_prob, mean, std, std)


def cps_step(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
             noise_level: float, sigma_after_one: torch.Tensor | float = 0.0,
             noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None) -> SDEStep:
    """One CPS transition from ``sigma`` to ``sigma_next`` (scalars or ``[B]``); arguments and result as
    :func:`rollout.sde.sde_step` (``std_dev_t`` = ``step_std`` = s, float32 ``[B]``; ``sigma_after_one``
    is unused: CPS never divides by 1 - sigma). ``noise_level`` in [0, 1]. Raises ``ValueError`` if
    neither ``noise`` nor ``prev_sample`` is given while the step is stochastic."""
    sigma, sigma_next = batch_sigmas(sigma, x), batch_sigmas(sigma_next, x)
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    return preserving_transition(x, velocity, sigma, sigma_next, std, noise=noise, prev_sample=prev_sample,
                                 name="cps_step")


cps_step.noise_level_max = 1.0  # sin(noise_level * pi / 2) must not pass 1
