"""Registry of rollout step types: how one transition x_t -> x_next is drawn and scored.

A step type is a function ``step(x, velocity, sigma, sigma_next, *, noise_level, sigma_after_one,
noise=None, prev_sample=None) -> SDEStep`` (see :func:`rollout.sde.sde_step` for the contract: float32
math, ``log_prob`` float32 ``[B]``). The sampler records the step type's name on every Trajectory and
the recomputation looks it up here, so sampling and training always use the same step. A new step
type is a file with its step function plus one entry in :data:`STEPS`,
or :func:`register_step` from code of your own before the config is loaded.
"""

from __future__ import annotations

from typing import Callable

from pretrain.registry import Registry
from rollout.cps import cps_step
from rollout.ddim import ddim_step
from rollout.ode import ode_step
from rollout.sde import sde_step

#: ``sde``: Flow-GRPO's SDE (Liu et al. 2025); ``cps``: Coefficients-Preserving Sampling (Wang et al. 2025);
#: ``ddim``: DDIM with eta = noise_level (Song et al. 2021), DDPO's sampler (Black et al. 2023).
#: ``ode``: the deterministic Euler step, no log-probs (forward-process methods: NFT, AWM, DGPO).
#: A step function may set ``noise_level_max`` (checked when the config loads) and ``deterministic``
#: (every transition is then taken by ``rollout.ode_solver``; nothing to recompute).
STEPS = Registry("step type", {"sde": sde_step, "cps": cps_step, "ddim": ddim_step, "ode": ode_step},
                 key="rollout.step")


def register_step(name: str, fn: Callable) -> None:
    """Add step type ``name`` (``ValueError`` if the name is taken by another function)."""
    STEPS.register(name, fn)


def get_step(name: str, key: str = "rollout.step") -> Callable:
    """The step function registered as ``name``; ``ValueError`` naming ``key`` and the known names."""
    return STEPS.get(name, key)
