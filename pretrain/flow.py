"""Rectified-flow objective and the Euler ODE sampler with classifier-free guidance.

Convention: x_sigma = (1 - sigma) x0 + sigma eps, the model predicts the velocity v = eps - x0,
an Euler step from sigma to sigma_next is x + (sigma_next - sigma) v (Lipman et al. 2023;
Liu et al. 2023 "rectified flow"; SD3, Esser et al. 2024, eq. 1-3).
"""

from __future__ import annotations

from typing import Callable

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _bcast(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    return sigma.reshape(sigma.shape + (1,) * (x.ndim - sigma.ndim)) if sigma.ndim else sigma


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma noise. ``sigma`` is a scalar or ``[B]``; x0/noise ``[B, ...]``."""
    s = _bcast(sigma, x0)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The regression target v = eps - x0 (same shape as x0)."""
    return noise - x0


def flow_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-sample rectified-flow loss ``[B]`` float32: mean over non-batch elements of
    (v_pred - (eps - x0))^2, computed in float32 whatever the model dtype. Average it for a scalar."""
    err = v_pred.float() - velocity_target(x0.float(), noise.float())
    return err.square().flatten(1).mean(1)


def noise_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                        sigma: torch.Tensor) -> torch.Tensor:
    """Per-sample epsilon-prediction loss ``[B]`` float32 (DDPM's L_simple, Ho et al. 2020, eq. 14) of a
    velocity prediction: the noise prediction at (x_sigma, sigma) is eps_hat = x_sigma + (1 - sigma) v_pred,
    so eps_hat - eps = (1 - sigma)(v_pred - (eps - x0)), and the loss is the mean over non-batch elements
    of ((1 - sigma)(v_pred - (eps - x0)))^2, in float32. ``sigma``: ``[B]`` in [0, 1]."""
    return (1 - sigma.float()).square() * flow_matching_loss(v_pred, x0, noise)


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance (Ho & Salimans 2022): v_uncond + w (v_cond - v_uncond).
    ``guidance_scale`` 1 returns v_cond. The one function rollout and training both use."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """One Euler ODE step x + (sigma_next - sigma) v; sigmas scalar or ``[B]``."""
    return x + _bcast(sigma_next - sigma, x) * v


@torch.no_grad()
def euler_sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    callback: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Integrate the ODE from ``sigmas[0]`` (usually 1, pure noise) to ``sigmas[-1]`` (usually 0).

    Args:
        velocity_fn: ``(x [B, ...], sigma [B]) -> v [B, ...]`` (already guided, see :func:`cfg_combine`).
        noise: ``[B, ...]`` initial state x_{sigmas[0]}.
        sigmas: float32 ``[T + 1]`` from :func:`pretrain.schedule.sigma_schedule`.
        callback: called as ``callback(i, sigma_{i+1}, x_{i+1})`` after every step.
    Returns:
        x at ``sigmas[-1]``, same shape and dtype as ``noise``.
    """
    x = noise
    for i in range(len(sigmas) - 1):
        s = sigmas[i].expand(x.shape[0]).to(x.device)
        v = velocity_fn(x, s)
        x = euler_step(x, v.to(x.dtype), sigmas[i].to(x.device), sigmas[i + 1].to(x.device))
        if callback is not None:
            callback(i, sigmas[i + 1], x)
    return x
