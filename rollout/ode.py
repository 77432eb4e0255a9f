"""The deterministic step type ``ode``: rollouts that need no log-probs.

Forward-process methods (DiffusionNFT, Zheng et al. 2025, arXiv 2509.16117; Advantage Weighted
Matching, Xue et al. 2025, arXiv 2509.25050; DGPO, Luo et al. 2025, arXiv 2510.08425) train on the
forward (noising) process of the rollouts' clean samples, so the rollout can be any deterministic
solver. With ``step: ode`` every transition is taken by ``rollout.ode_solver`` (``euler``, this
step; or ``dpmpp_2m``), the trajectory records ``ode`` and every log-prob is 0.
"""

from __future__ import annotations

import torch

from rollout.sde import SDEStep, batch_sigmas, per_sample


def ode_step(x: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next, *, noise_level: float = 0.0,
             sigma_after_one=None, noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None
             ) -> SDEStep:
    """The Euler step x + (sigma_next - sigma) v, float32 ``[B, ...]`` (``x``, ``velocity`` ``[B, ...]``;
    ``sigma``, ``sigma_next`` scalars or ``[B]``). ``log_prob``, ``std_dev_t``, ``step_std``: float32
    zeros ``[B]``. ``noise_level``, ``sigma_after_one`` and ``noise`` are accepted (the step-type
    contract of :mod:`rollout.steps`) and unused; ``prev_sample`` is returned as the next state when
    given."""
    sigma, sigma_next = batch_sigmas(sigma, x), batch_sigmas(sigma_next, x)
    mean = x.float() + velocity.float() * per_sample(sigma_next - sigma, x)
    zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return SDEStep(mean if prev_sample is None else prev_sample, zeros, mean, zeros, zeros)


ode_step.deterministic = True  # the sampler takes every transition with rollout.ode_solver
