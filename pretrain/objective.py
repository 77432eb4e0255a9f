"""The pretraining objective on one micro-batch, with rank-free per-sample randomness.

Two named objectives (``flow.objective``), each a sigma distribution and the error it regresses:

- ``rectified_flow`` (default; SD3, Esser et al. 2024, arXiv 2403.03206, sec. 3.1): logit-normal sigmas
  with ``shift``, loss on the velocity, (v_hat - (eps - x0))^2;
- ``epsilon`` (DDPM, Ho et al. 2020, arXiv 2006.11239, Algorithm 1 and eq. 14; how SD 1.x / 2.x were
  trained): timesteps uniform over the model's discrete training timesteps
  (:meth:`pretrain.backbone.Backbone.train_sigmas`), loss on the noise, (eps_hat - eps)^2 =
  (1 - sigma)^2 (v_hat - v)^2. ``logit_mean``, ``logit_std`` and ``shift`` are not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pretrain.flow import flow_matching_loss, interpolate, noise_matching_loss
from pretrain.schedule import sample_discrete_training_sigmas, sample_training_sigmas
from pretrain.seeding import generator_for
from pretrain.guidance import drop_condition
from pretrain.text_encoder import PromptEmbeds


@dataclass(frozen=True)
class Objective:
    """One named objective: ``draw(generators, cfg, train_sigmas) -> sigma [B] float32`` (one draw per
    generator) and ``loss(v_pred, x0, noise, sigma) -> [B] float32``; ``discrete``: it draws from the
    model's training-timestep table (``train_sigmas`` required)."""

    draw: Callable[[list[torch.Generator], "FlowConfig", torch.Tensor | None], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    discrete: bool = False


OBJECTIVES: dict[str, Objective] = {
    "rectified_flow": Objective(
        draw=lambda gens, cfg, table: sample_training_sigmas(gens, cfg.logit_mean, cfg.logit_std, cfg.shift),
        loss=lambda v, x0, noise, sigma: flow_matching_loss(v, x0, noise)),
    "epsilon": Objective(draw=lambda gens, cfg, table: sample_discrete_training_sigmas(gens, table),
                         loss=noise_matching_loss, discrete=True),
}


@dataclass
class FlowConfig:
    """The training objective (``objective``: a name in :data:`OBJECTIVES`, see the module docstring);
    for ``rectified_flow``, logit-normal sigmas (``logit_mean``, ``logit_std``) with ``shift``;
    ``cond_dropout``: probability of training a sample on the empty prompt (for CFG)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    cond_dropout: float = 0.1
    objective: str = "rectified_flow"

    def validate(self, prefix: str = "") -> None:
        get_objective(self.objective, f"{prefix}objective")


def get_objective(name: str, key: str = "flow.objective") -> Objective:
    """``OBJECTIVES[name]``; ``ValueError`` naming ``key`` for an unknown name."""
    if name not in OBJECTIVES:
        raise ValueError(f"{key}: '{name}' is not one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def objective_sigmas(model, cfg: FlowConfig, key: str = "flow.objective") -> torch.Tensor | None:
    """The table ``cfg.objective`` draws sigmas from: ``model.train_sigmas()`` (float32 ``[T]``) for a
    discrete objective, None otherwise. Raises ``ValueError`` naming ``key`` for an unknown objective, or
    a discrete one on a model without training timesteps."""
    if not get_objective(cfg.objective, key).discrete:
        return None
    table = model.train_sigmas()
    if table is None:
        raise ValueError(f"{key}: '{cfg.objective}' draws the model's discrete training timesteps; "
                         f"{type(model).__name__} has none (use rectified_flow)")
    return table


def draw_training_noise(x0: torch.Tensor, seed: int, step: int, indices: list[int], cfg: FlowConfig,
                        stream: str = "train", train_sigmas: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (noise ``[B, ...]``, sigma ``[B]``, drop ``[B]`` bool), sample i drawn from the
    generator (seed, stream, step, indices[i]) in that order, on CPU, then moved to x0's device. The
    sigma comes from ``cfg.objective``'s distribution (a discrete one draws from ``train_sigmas``, see
    :func:`objective_sigmas`; ``ValueError`` naming ``flow.objective`` if it is None)."""
    objective = get_objective(cfg.objective)
    if objective.discrete and train_sigmas is None:
        raise ValueError(f"flow.objective: '{cfg.objective}' needs the model's training sigmas (objective_sigmas)")
    gens = [generator_for(seed, stream, step, i) for i in indices]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
    sigma = objective.draw(gens, cfg, train_sigmas)
    drop = torch.stack([torch.rand((), generator=g) < cfg.cond_dropout for g in gens])
    return noise.to(x0.device), sigma.to(x0.device), drop.to(x0.device)


def pretrain_loss(model, x0: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                  noise: torch.Tensor, sigma: torch.Tensor, drop: torch.Tensor,
                  objective: str = "rectified_flow", per_sample: bool = False) -> torch.Tensor:
    """Mean loss (float32 scalar; ``[B]`` per sample with ``per_sample``) of ``objective`` (a name in
    :data:`OBJECTIVES`) of ``model(x_sigma, sigma, embeds) -> v`` on latents ``x0 [B, C, h, w]``; samples
    with ``drop`` use ``null_embeds`` (``[1, ...]``). ``ValueError`` naming ``flow.objective`` for an
    unknown objective."""
    loss = get_objective(objective).loss
    x_t = interpolate(x0, noise, sigma)
    v = model(x_t, sigma, drop_condition(embeds, null_embeds, drop))
    per = loss(v, x0, noise, sigma)
    return per if per_sample else per.mean()
