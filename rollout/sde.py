"""The Flow-GRPO SDE step with its Gaussian log-probability (Liu et al. 2025, arXiv 2505.05470).

The reverse-time SDE with the same marginals as the flow ODE, discretised with Euler-Maruyama
(Flow-GRPO, eq. 9-10 and its reference implementation). With dt = sigma_next - sigma (< 0) and
std_dev_t = noise_level * sqrt(sigma / (1 - sigma)) (at sigma = 1 the denominator uses the next
sigma of the schedule, so there is no division by zero):

    mean   = x + v dt + std_dev_t^2 / (2 sigma) * (x + (1 - sigma) v) dt
    x_next = mean + std_dev_t * sqrt(-dt) * z,   z ~ N(0, I)

With noise_level = 0 the step is exactly the Euler step x + v dt. All density math is float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SDEStep:
    """One transition. ``prev_sample``/``mean``: float32 ``[B, ...]``; ``log_prob``: float32 ``[B]``,
    the Gaussian log-density of ``prev_sample`` averaged over all non-batch elements (Flow-GRPO's
    per-element scale; 0 where the step is deterministic); ``std_dev_t``: float32 ``[B]``;
    ``step_std`` = std_dev_t * sqrt(-dt), float32 ``[B]``."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std_dev_t: torch.Tensor
    step_std: torch.Tensor


def per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B]`` reshaped to ``[B, 1, ...]`` to broadcast against ``like`` ``[B, ...]``."""
    return t.reshape(t.shape + (1,) * (like.ndim - t.ndim))


def batch_sigmas(sigma, like: torch.Tensor) -> torch.Tensor:
    """A sigma (a scalar or ``[B]``) as float32 ``[B]`` on ``like``'s device (B = ``like.shape[0]``)."""
    return torch.as_tensor(sigma, dtype=torch.float32, device=like.device).expand(like.shape[0])


def sde_std_dev(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
                sigma_after_one: torch.Tensor | float) -> torch.Tensor:
    """std_dev_t = noise_level * sqrt(sigma / (1 - sigma')) with sigma' = ``sigma_after_one`` where
    sigma == 1 (Flow-GRPO uses the schedule's second sigma there). float32, shape of ``sigma``."""
    sigma = sigma.float()
    denom_sigma = torch.where(sigma >= 1.0, torch.as_tensor(sigma_after_one, dtype=torch.float32), sigma)
    return noise_level * torch.sqrt(sigma / (1 - denom_sigma))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) averaged over non-batch elements, float32 ``[B]``; ``std`` is ``[B]``.
    Rows with std == 0 give 0 (a deterministic step carries no density)."""
    x, mean, std = x.float(), mean.float(), std.float()
    safe = torch.where(std > 0, std, torch.ones_like(std))
    lp = (-((x - mean) ** 2) / (2 * per_sample(safe, x) ** 2) - torch.log(per_sample(safe, x)) - 0.5 * math.log(2 * math.pi))
    return torch.where(std > 0, lp.flatten(1).mean(1), torch.zeros_like(std))


def gaussian_transition(mean: torch.Tensor, step_std: torch.Tensor, noise: torch.Tensor | None,
                        prev_sample: torch.Tensor | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(next state, its log-prob ``[B]``) of a Gaussian transition N(mean, step_std^2) (``mean`` float32
    ``[B, ...]``, ``step_std`` float32 ``[B]``): ``prev_sample`` when given (evaluation), else
    mean + step_std * noise. ``ValueError`` naming the step ``name`` when neither is given while the
    step is stochastic."""
    if prev_sample is None:
        if noise is None:
            if bool((step_std > 0).any()):
                raise ValueError(f"{name}: pass `noise` to sample or `prev_sample` to evaluate")
            noise = torch.zeros_like(mean)
        prev_sample = mean + per_sample(step_std, mean) * noise.float()
    return prev_sample, gaussian_log_prob(prev_sample, mean, step_std)


def sde_step(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
             noise_level: float, sigma_after_one: torch.Tensor | float,
             noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None) -> SDEStep:
    """One SDE transition from ``sigma`` to ``sigma_next`` (scalars or ``[B]``).

    Args:
        x, velocity: ``[B, ...]`` state and model velocity (any dtype; math in float32).
        noise: z ``[B, ...]`` for sampling; ignored when ``prev_sample`` is given.
        prev_sample: an already-sampled next state whose log-prob to evaluate (training-time
            recomputation); then ``SDEStep.prev_sample`` is that tensor.
        sigma_after_one: the schedule's sigma after 1 (``sigmas[1]``), used where sigma == 1.
    Raises ``ValueError`` if neither ``noise`` nor ``prev_sample`` is given while the step is
    stochastic."""
    x32, v32 = x.float(), velocity.float()
    sigma, sigma_next = batch_sigmas(sigma, x), batch_sigmas(sigma_next, x)
    dt = sigma_next - sigma
    std_dev_t = sde_std_dev(sigma, sigma_next, noise_level, sigma_after_one)
    s, d = per_sample(sigma, x32), per_sample(dt, x32)
    mean = x32 + v32 * d + (per_sample(std_dev_t, x32) ** 2 / (2 * s)) * (x32 + (1 - s) * v32) * d
    step_std = std_dev_t * torch.sqrt(-dt)
    prev_sample, log_prob = gaussian_transition(mean, step_std, noise, prev_sample, "sde_step")
    return SDEStep(prev_sample, log_prob, mean, std_dev_t, step_std)
