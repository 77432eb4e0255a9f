"""Advantage estimators: group-normalised rewards (GRPO, Flow-GRPO) and per-reward group advantages
(DanceGRPO). The math is :mod:`posttrain.objectives.advantages`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.objectives.advantages import group_advantages, per_reward_advantages
from posttrain.grpo.parts.registry import ADVANTAGES


@dataclass
class ClipConfig:
    """``clip_max``: advantages are clipped to +/- this (Flow-GRPO's ``adv_clip_max``, 5)."""

    clip_max: float = 5.0

    def validate(self, prefix: str = "") -> None:
        if self.clip_max <= 0:
            raise ValueError(f"{prefix}clip_max: must be > 0, got {self.clip_max}")


@ADVANTAGES.register("group")
class GroupAdvantage:
    """A = (r - mean) / (std + 1e-4) per prompt group on the weighted sum of rewards (GRPO: Shao et al.
    2024, arXiv 2402.03300, eq. 3; Flow-GRPO eq. 4); :func:`posttrain.objectives.advantages.group_advantages`."""

    Config = ClipConfig

    def __init__(self, cfg: ClipConfig):
        self.cfg = cfg

    def __call__(self, total: torch.Tensor, raw: dict, weights: dict, group_ids: torch.Tensor,
                 prompt_ids: torch.Tensor):
        return group_advantages(total, group_ids, self.cfg.clip_max)


@ADVANTAGES.register("per_reward")
class PerRewardAdvantage:
    """Group advantages of each reward separately, then their weighted sum (DanceGRPO, Xue et al. 2025,
    arXiv 2505.07818), so a reward's scale does not set its influence;
    :func:`posttrain.objectives.advantages.per_reward_advantages`."""

    Config = ClipConfig

    def __init__(self, cfg: ClipConfig):
        self.cfg = cfg

    def __call__(self, total: torch.Tensor, raw: dict, weights: dict, group_ids: torch.Tensor,
                 prompt_ids: torch.Tensor):
        return per_reward_advantages(raw, weights, group_ids, self.cfg.clip_max)
