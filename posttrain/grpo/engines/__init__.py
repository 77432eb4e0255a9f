"""Rollout engines: what produces an iteration's trajectories and rewards for the GRPO trainer.

``rollout.engine: local`` (:class:`posttrain.grpo.engines.local.LocalEngine`): every trainer rank samples its
own share and scores it, as flow_grpo and DanceGRPO do. ``rollout.engine: ray``
(:class:`posttrain.grpo.engines.ray_engine.RayEngine`): rollout workers (Ray actors, each an inference copy
of the policy and the sampler) sample requests sent by the trainer's rank 0 and get the weights after
each iteration's update; ``rollout.mode`` sync / one_step_off / async sets how far sampling runs ahead
of training. Both return a :class:`RolloutBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pretrain.registry import Registry
from rollout.trajectory import Trajectory


@dataclass
class RolloutBatch:
    """One iteration's rollout as the update sees it: ``picked`` the prompt indices (every rank the
    same), ``traj`` this rank's share of the samples, ``total`` float32 ``[N]`` / ``raw``
    ``{reward: float32 [N]}`` / ``group_ids`` long ``[N]`` over all ranks' samples in global order,
    ``metrics`` the engine's per-iteration figures (seconds, staleness, bytes)."""

    picked: list[int]
    traj: Trajectory
    total: torch.Tensor
    raw: dict[str, torch.Tensor]
    group_ids: torch.Tensor
    metrics: dict = field(default_factory=dict)


#: ``rollout.engine`` names; lazy entries, so Ray is imported only when asked for.
ENGINES = Registry("rollout engine", {"local": "posttrain.grpo.engines.local:LocalEngine",
                                      "ray": "posttrain.grpo.engines.ray_engine:RayEngine"}, key="rollout.engine")


def build_engine(run):
    """The engine ``run.cfg.rollout.engine`` names (:data:`ENGINES`, imported on use: Ray only when
    asked for), for a :class:`posttrain.grpo.stage.GRPORun`."""
    return ENGINES.get(run.cfg.rollout.engine)(run)
