"""Registry of the deterministic solvers for the transitions after the SDE window (``rollout.ode_solver``).

Before the window and inside it the sampler calls the step type (:mod:`rollout.steps`); after it, the
solver named here. A solver is ``solver(step, x, velocity, sigma, sigma_next, previous, **step_kwargs)
-> SDEStep``: ``step`` the trajectory's step function, ``previous`` = (x, velocity, sigma) of the
transition before (None for the first transition), ``step_kwargs`` what the sampler passes the step
(``sigma_after_one``, ``noise``). Its ``log_prob`` is 0: a deterministic transition is never trained,
and the training recomputation evaluates only the window's transitions, whose step does not depend on
the solver.

- ``euler``: the step type at noise level 0, i.e. the Euler step x + (sigma_next - sigma) v (the
  default; bit for bit what the sampler does without this option);
- ``dpmpp_2m``: DPM-Solver++(2M) (:mod:`rollout.dpm_solver`), as MixGRPO-Flash (Li et al. 2025,
  arXiv 2507.21802) samples after the window. Its first step uses the last window transition's
  velocity as the multistep history.
"""

from __future__ import annotations

from typing import Callable

import torch

from rollout.dpm_solver import dpmpp_2m_update, flow_data_prediction
from rollout.sde import SDEStep
from pretrain.registry import Registry


def euler(step: Callable, x: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next, previous, **step_kwargs
          ) -> SDEStep:
    """The step type ``step`` at noise level 0 (its deterministic Euler step); ``previous`` is unused."""
    return step(x, velocity, sigma, sigma_next, noise_level=0.0, **step_kwargs)


def dpmpp_2m(step: Callable, x: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next,
             previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, **step_kwargs) -> SDEStep:
    """DPM-Solver++(2M) from ``sigma`` to ``sigma_next`` (:func:`rollout.dpm_solver.dpmpp_2m_update`) with
    the data prediction x0_hat = x - sigma v of ``previous`` = (x, velocity, sigma) as its history
    (first order without one). ``x``, ``velocity``: ``[B, ...]``; result float32, ``log_prob``,
    ``std_dev_t``, ``step_std`` float32 zeros ``[B]``; ``step`` and ``step_kwargs`` are unused."""
    x0 = flow_data_prediction(x, velocity, sigma)
    x0_prev, sigma_prev = (None, None) if previous is None else (flow_data_prediction(*previous), previous[2])
    x_next = dpmpp_2m_update(x, x0, sigma, sigma_next, x0_prev, sigma_prev)
    zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return SDEStep(x_next, zeros, x_next, zeros, zeros)


#: ``rollout.ode_solver`` names: ``euler`` (default), ``dpmpp_2m`` (MixGRPO-Flash).
ODE_SOLVERS = Registry("ODE solver", {"euler": euler, "dpmpp_2m": dpmpp_2m}, key="rollout.ode_solver")


def get_ode_solver(name: str, key: str = "rollout.ode_solver") -> Callable:
    """The solver registered as ``name``; ``ValueError`` naming ``key`` and the known names."""
    return ODE_SOLVERS.get(name, key)
