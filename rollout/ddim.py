"""The DDIM step with eta > 0 and its Gaussian log-probability, as DDPO samples and trains
(Song et al. 2021, arXiv 2010.02502, eq. 12 and 16; Black et al. 2023, arXiv 2305.13301, sec. 4.3),
stated in this project's flow coordinates so it runs on every family.

A variance-preserving model state x_t = alpha x0 + s eps (alpha^2 + s^2 = 1) is the flow state
y = (1 - sigma) x0 + sigma eps scaled: y = n x_t with n(sigma) = sqrt((1 - sigma)^2 + sigma^2),
alpha = (1 - sigma) / n, s = sigma / n (:mod:`pretrain.models.unet.vp_schedule`). With
a = alpha(sigma)^2, a' = alpha(sigma_next)^2 and eta = ``noise_level``, DDIM's step in x_t is

    std_x  = eta * sqrt((1 - a') / (1 - a)) * sqrt(1 - a / a')
    x_next = sqrt(a') x0_hat + sqrt(1 - a' - std_x^2) eps_hat + std_x z,   z ~ N(0, I)

and multiplying by n' = n(sigma_next) gives the same step on y:

    std    = n' std_x
    mean   = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat
    y_next = mean + std z

with x0_hat = y - sigma v and eps_hat = y + (1 - sigma) v: CPS's form (:mod:`rollout.cps`) with DDIM's
std. eta = 0 is the Euler step; eta = 1 is DDPO's sampler. The log-prob is the full Gaussian log-density
of y_next averaged over elements, so it equals DDPO's log-prob of x_next minus log n' (a constant of the
transition that cancels in every ratio); the KL to the reference uses the same std.
"""

from __future__ import annotations

import torch

from rollout.cps import preserving_transition
from rollout.sde import SDEStep, batch_sigmas


def vp_alpha_squared(sigma: torch.Tensor) -> torch.Tensor:
    """a = alphas_cumprod of the VP state at flow ``sigma`` (float32, shape of ``sigma``):
    (1 - sigma)^2 / ((1 - sigma)^2 + sigma^2), in [0, 1]."""
    sigma = sigma.float()
    return (1 - sigma).square() / ((1 - sigma).square() + sigma.square())


def ddim_std(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float) -> torch.Tensor:
    """DDIM's noise std in flow coordinates, n(sigma_next) * eta * sqrt((1 - a') / (1 - a) * (1 - a / a')),
    float32 ``[B]`` for ``sigma`` > ``sigma_next`` ``[B]``; 0 at sigma_next = 0 (a' = 1)."""
    a, a_next = vp_alpha_squared(sigma), vp_alpha_squared(sigma_next)
    n_next = ((1 - sigma_next.float()).square() + sigma_next.float().square()).sqrt()
    var = (1 - a_next) / (1 - a).clamp(min=1e-12) * (1 - a / a_next)
    return n_next * eta * var.clamp(min=0.0).sqrt()


def ddim_step(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
              noise_level: float, sigma_after_one: torch.Tensor | float = 0.0,
              noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None) -> SDEStep:
    """One DDIM transition with eta = ``noise_level`` in [0, 1] from ``sigma`` to ``sigma_next`` (scalars or
    ``[B]``, flow sigmas); arguments and result as :func:`rollout.sde.sde_step` (``std_dev_t`` =
    ``step_std`` = the flow-coordinate std, float32 ``[B]``; ``sigma_after_one`` is unused). Raises
    ``ValueError`` if neither ``noise`` nor ``prev_sample`` is given while the step is stochastic."""
    sigma, sigma_next = batch_sigmas(sigma, x), batch_sigmas(sigma_next, x)
    std = ddim_std(sigma, sigma_next, noise_level)
    return preserving_transition(x, velocity, sigma, sigma_next, std, noise=noise, prev_sample=prev_sample,
                                 name="ddim_step")


ddim_step.noise_level_max = 1.0  # eta: 1 is DDPM's posterior variance
