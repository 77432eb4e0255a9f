"""Rewards on their own Ray actors (``reward_engine.engine: ray``, with ``engine.name: ray``): each
actor builds the run's composite reward (``rewards:``) once and scores rollout results as they arrive,
reading each result from Ray's object store itself (the trainer does not send the images again)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.engines.config import check_actors


@dataclass
class RewardEngineConfig:
    """``reward_engine``. ``engine``: ``local`` (the trainer's rank 0 scores, in ``perf.reward_workers``
    threads) or ``ray`` (``actors`` Ray actors with ``num_cpus`` / ``num_gpus`` each, results assigned
    round-robin)."""

    engine: str = "local"
    actors: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def validate(self, prefix: str = "") -> None:
        if self.engine not in ("local", "ray"):
            raise ValueError(f"{prefix}engine: '{self.engine}' is not one of local, ray")
        check_actors(self, prefix, "actors")


class RewardActor:
    """``rewards``: the run's ``{name: weight or spec}`` (:class:`rewards.base.CompositeReward`);
    ``threads``: torch threads of the actor."""

    def __init__(self, rewards: dict, threads: int = 1):
        from rewards.base import CompositeReward

        torch.set_num_threads(max(1, threads))
        self.reward = CompositeReward(rewards)

    def score(self, result) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total float32 ``[B]``, ``{name: raw float32 [B]}``) of a
        :class:`rollout.records.RolloutResult`'s images, prompts and sample ids."""
        t = result.trajectory
        return self.reward(t.images, t.prompts, t.reward_metadata(result.iteration))
