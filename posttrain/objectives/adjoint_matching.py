"""Adjoint Matching (Domingo-Enrich et al. 2025, arXiv 2409.08861): reward fine-tuning as stochastic optimal
control, solved by regression onto the lean adjoint.

Time here is the paper's: t in [0, 1] from noise (t = 0) to data (t = 1), X_t = (1 - t) X_0 + t X_1, so
t = 1 - sigma of :mod:`pretrain.flow` and the paper's velocity is v = dX/dt = -(the model's output).
For this interpolation (alpha_t = t, beta_t = 1 - t) the **memoryless** noise schedule (sec. 4,
eq. 12 with eta_t = beta_t (alpha'_t beta_t / alpha_t - beta'_t)) is

    sigma(t)^2 = 2 eta_t = 2 (1 - t) / t,      drift b(x, t) = 2 v(x, t) - x / t,

and the SDE dX = b dt + sigma(t) dB has the flow's marginals with X_0 independent of X_1, so tilting its
paths by exp(r(X_1)) leaves X_0 ~ N(0, I) and makes X_1 ~ p_base(x) exp(r(x)) / Z. A fine-tuned model's
drift 2 v_ft - x / t differs by sigma(t) u with the control u = 2 (v_ft - v_base) / sigma(t).

**The lean adjoint** (eq. 39-40): along a trajectory of the current model (no gradient),
da/dt = -(d b_base / dx)^T a with a(1) = -grad r(X_1), integrated backward; the base drift's Jacobian
enters only as vector-Jacobian products. **The loss** (eq. 41): sum over t of
|u(X_t, t) + sigma(t) a(t)|^2, i.e. the fine-tuned velocity regresses onto
v_base - sigma(t)^2 a(t) / 2, whose conditional mean at the optimum is the tilted distribution's flow
velocity (tested on 1-D Gaussians, where it is known in closed form).
"""

from __future__ import annotations

from typing import Callable

import torch


def memoryless_sigma2(t: torch.Tensor | float) -> torch.Tensor | float:
    """sigma(t)^2 = 2 (1 - t) / t of the memoryless schedule for X_t = (1 - t) X_0 + t X_1 (t > 0)."""
    return 2 * (1 - t) / t


def drift(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """b(x, t) = 2 v(x, t) - x / t: the memoryless SDE's drift for the velocity ``v`` (paper time)."""
    return 2 * v - x / t


def memoryless_step(x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, noise: torch.Tensor) -> torch.Tensor:
    """One Euler-Maruyama step of dX = b dt + sigma(t) dB from ``t`` to ``t_next``: x + h b + sqrt(h)
    sigma(t) noise (``noise`` unit Gaussian like ``x``)."""
    h = t_next - t
    return x + h * drift(v, x, t) + (h * memoryless_sigma2(t)) ** 0.5 * noise


def lean_adjoint(drift_vjp: Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor], xs: list[torch.Tensor],
                 ts: list[float], a_final: torch.Tensor) -> list[torch.Tensor]:
    """The lean adjoint a_k at each ``ts[k]`` (increasing, the last 1) of the trajectory ``xs`` (states at
    ``ts``), from ``a_final`` = -grad r(X_1) backward by Euler: a_k = a_{k+1} + h_k (db/dx)^T a_{k+1} at
    (x_{k+1}, t_{k+1}). ``drift_vjp(x, t, a)`` returns (d b_base / dx at (x, t))^T a. Detached tensors."""
    out = [a_final.detach()]
    for k in range(len(ts) - 2, -1, -1):
        a = out[-1]
        out.append((a + (ts[k + 1] - ts[k]) * drift_vjp(xs[k + 1], ts[k + 1], a)).detach())
    return out[::-1]


def regression_target(v_base: torch.Tensor, a: torch.Tensor, t: float) -> torch.Tensor:
    """v_base - sigma(t)^2 a / 2: the velocity the fine-tuned model regresses onto at time ``t``."""
    return v_base - memoryless_sigma2(t) * a / 2


def adjoint_matching_loss(v_ft: torch.Tensor, v_base: torch.Tensor, a: torch.Tensor, t: float) -> torch.Tensor:
    """|u + sigma(t) a|^2 per sample, float32 ``[B]`` (mean over the non-batch elements), with the control
    u = 2 (v_ft - v_base) / sigma(t); zero exactly when ``v_ft`` is :func:`regression_target`. ``v_base``
    and ``a`` carry no gradient."""
    sigma = memoryless_sigma2(t) ** 0.5
    u = 2 * (v_ft.float() - v_base.detach().float()) / sigma
    return (u + sigma * a.detach().float()).square().flatten(1).mean(1)


def adjoint_matching(chain, steps: int, reward_scale: float,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """One Adjoint Matching loss on a :class:`posttrain.objectives.reward_gradient.Chain` with
    ``chain.base_velocity`` (the reference model; the chain's sigmas run from 1 to 0, t = 1 - sigma, and a
    velocity in the model's convention is -v of the paper's).

    1. A trajectory of the current model without gradient: the first step (from t = 0, where the
       memoryless drift is singular) by Euler, then the memoryless SDE (:func:`memoryless_step`), noise
       from ``generator``.
    2. a(1) = -``reward_scale`` grad r(X_1) through the decoder, then :func:`lean_adjoint` with the base
       drift's vector-Jacobian products.
    3. The loss: :func:`adjoint_matching_loss` at ``steps`` times drawn among the interior ones
       (0 < t < 1), averaged. Metrics: ``reward`` (of X_1), ``grad_steps``."""
    sig = chain.sigmas
    ts = [1.0 - float(s) for s in sig]
    n = len(ts) - 1

    def paper_v(velocity, x, k):  # the paper's velocity at state x of step k
        return -velocity(x, sig[k].expand(x.shape[0]))

    with torch.no_grad():
        xs, x = [chain.noise], chain.noise
        for k in range(n):
            v = paper_v(chain.velocity, x, k)
            if ts[k] <= 0:
                x = x + (ts[k + 1] - ts[k]) * v
            else:
                noise = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
                x = memoryless_step(x, v, ts[k], ts[k + 1], noise)
            xs.append(x)
    x1 = xs[-1].detach().requires_grad_(True)
    reward = chain.score(x1)
    a_final = -reward_scale * torch.autograd.grad(reward.sum(), x1)[0]
    k_of = {t: k for k, t in enumerate(ts)}

    def vjp(x, t, a):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            b = drift(paper_v(chain.base_velocity, x, k_of[t]), x, t)
            return torch.autograd.grad(b, x, a)[0]

    first = 1 if ts[0] <= 0 else 0  # states with t > 0
    adj = lean_adjoint(vjp, xs[first:], ts[first:], a_final)
    interior = [k for k in range(first, n) if 0 < ts[k] < 1]
    order = torch.randperm(len(interior), generator=generator)[:max(1, steps)].tolist()
    losses = []
    for i in sorted(order):
        k = interior[i]
        with torch.no_grad():
            v_base = paper_v(chain.base_velocity, xs[k], k)
        v_ft = paper_v(chain.velocity, xs[k].detach(), k)
        losses.append(adjoint_matching_loss(v_ft, v_base, adj[k - first], ts[k]).mean())
    return torch.stack(losses).mean(), {"reward": reward.mean().item(), "grad_steps": float(len(losses))}
