"""DPM-Solver++(2M) in flow-matching coordinates: the second-order multistep ODE step that MixGRPO-Flash
(Li et al. 2025, arXiv 2507.21802) takes after the SDE window.

DPM-Solver++ (Lu et al. 2022, arXiv 2211.01095) integrates the probability-flow ODE of
x = alpha x0 + sigma eps in the half log-SNR lambda = log(alpha / sigma) with the data prediction x0.
For flow matching alpha = 1 - sigma, and the velocity v = eps - x0 gives x0_hat = x - sigma v. From
state s (sigma_s) to t (sigma_t) with h = lambda_t - lambda_s:

    first order (DPM-Solver++1 = DDIM; in flow coordinates exactly the Euler step x + (sigma_t - sigma_s) v):
        x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) x0_hat
    2M, with the previous transition's data prediction x0_prev at sigma_prev (Algorithm 2):
        r   = h / h_prev,   h_prev = lambda_s - lambda_prev
        D   = x0_hat + r / 2 (x0_hat - x0_prev)
        x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) D

This is diffusers' ``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"``,
``solver_order=2``, ``solver_type="midpoint"``, ``prediction_type="flow_prediction"``: its first
step (no history) and its final step to sigma = 0 (``lower_order_final`` / ``final_sigmas_type="zero"``)
are first order, and the step to sigma = 0 is x0_hat. The coefficients are written without logarithms
of 0: e^-h = (sigma_t / alpha_t)(alpha_s / sigma_s), so alpha_t (1 - e^-h) = alpha_t - sigma_t alpha_s /
sigma_s; a previous sigma of 1 (lambda = -inf) gives r = 0, the first-order step, as in diffusers.
"""

from __future__ import annotations

import torch

from rollout.sde import batch_sigmas, per_sample


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log((1 - sigma) / sigma): -inf at sigma = 1, +inf at sigma = 0."""
    return torch.log1p(-sigma) - torch.log(sigma)


def flow_data_prediction(x: torch.Tensor, velocity: torch.Tensor, sigma) -> torch.Tensor:
    """x0_hat = x - sigma v, float32 ``[B, ...]`` (``x``, ``velocity``: ``[B, ...]`` any float dtype;
    ``sigma``: a scalar or ``[B]`` in [0, 1])."""
    x32 = x.float()
    return x32 - per_sample(batch_sigmas(sigma, x32), x32) * velocity.float()


def dpmpp_2m_update(x: torch.Tensor, x0: torch.Tensor, sigma, sigma_next, x0_prev: torch.Tensor | None = None,
                    sigma_prev=None) -> torch.Tensor:
    """One DPM-Solver++(2M) step (midpoint form, data prediction) from ``sigma`` to ``sigma_next``.

    Args:
        x: the state ``[B, ...]`` at ``sigma`` (any float dtype; math in float32).
        x0: its data prediction x0_hat ``[B, ...]`` (:func:`flow_data_prediction`).
        sigma, sigma_next: scalars or ``[B]``, 0 <= sigma_next < sigma <= 1.
        x0_prev, sigma_prev: the data prediction of the previous transition and its sigma (> ``sigma``,
            up to 1); None: no history, the first-order step.
    Returns x at ``sigma_next``, float32 ``[B, ...]``. First order where there is no history and on the
    step to sigma_next = 0, whose result is x0_hat (diffusers' ``lower_order_final``).
    Source: Lu et al. 2022, arXiv 2211.01095, Algorithm 2 (DPM-Solver++(2M))."""
    x32, d = x.float(), x0.float()
    s, t = batch_sigmas(sigma, x32), batch_sigmas(sigma_next, x32)
    ratio = t / s                            # sigma_t / sigma_s
    coef = (1 - t) - ratio * (1 - s)         # -alpha_t (e^-h - 1)
    if x0_prev is not None:
        lam_s = _half_log_snr(s)
        h, h_prev = _half_log_snr(t) - lam_s, lam_s - _half_log_snr(batch_sigmas(sigma_prev, x32))
        r = torch.where(t > 0, h / h_prev, torch.zeros_like(h))  # to sigma 0: first order
        d = d + per_sample(0.5 * r, d) * (d - x0_prev.float())
    return per_sample(ratio, x32) * x32 + per_sample(coef, x32) * d
