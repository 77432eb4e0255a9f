"""Rollout engines: what produces an iteration's trajectories and rewards for the GRPO trainer.

``engine.name: local`` (:class:`posttrain.grpo.engines.local.LocalEngine`): every trainer rank samples its
own share with its :class:`rollout.actor.RolloutActor` and scores it, as flow_grpo and DanceGRPO do.
``engine.name: ray`` (:class:`posttrain.grpo.engines.ray_engine.RayEngine`): rollout workers (Ray actors,
each an inference copy of the policy and a rollout actor of its own) sample requests sent by the
trainer's rank 0 and get the weights after each iteration's update; ``engine.mode`` sync / one_step_off
/ async sets how far sampling runs ahead of training. Both return a :class:`RolloutBatch`.

An engine is built from its collaborators, passed as keyword arguments (never the trainer):
``ENGINES.get(cfg.engine.name)(cfg=..., perf=..., actor=..., prompts=..., ranks=..., rewards=...,
scorer=..., policy=..., log=...)``; each takes the ones it needs.
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


#: ``engine.name`` names; lazy entries, so Ray is imported only when asked for.
ENGINES = Registry("rollout engine", {"local": "posttrain.grpo.engines.local:LocalEngine",
                                      "ray": "posttrain.grpo.engines.ray_engine:RayEngine"}, key="engine.name")
