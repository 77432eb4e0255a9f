"""Rollout engines: what produces an iteration's trajectories and rewards for the GRPO trainer.

``rollout.engine: local`` (:class:`posttrain.engines.local.LocalEngine`): every trainer rank samples its
own share and scores it, as flow_grpo and DanceGRPO do. ``rollout.engine: ray``
(:class:`posttrain.engines.ray_engine.RayEngine`): rollout workers (Ray actors, each an inference copy
of the policy and the sampler) sample requests sent by the trainer's rank 0 and get the weights after
each iteration's update; ``rollout.mode`` sync / one_step_off / async sets how far sampling runs ahead
of training. Both return a :class:`RolloutBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


ENGINES = {"local": "posttrain.engines.local:LocalEngine", "ray": "posttrain.engines.ray_engine:RayEngine"}


def build_engine(run):
    """The engine ``run.cfg.rollout.engine`` names (:data:`ENGINES`, imported on use: Ray only when
    asked for), for a :class:`posttrain.grpo.GRPORun`."""
    import importlib

    module, cls = ENGINES[run.cfg.rollout.engine].split(":")
    return getattr(importlib.import_module(module), cls)(run)
