"""Sample selection ``all``: train every sample with a finite reward (Flow-GRPO)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.parts.registry import SELECTIONS


@SELECTIONS.register("all")
class AllSamples:
    """mask = valid, or valid and not in a zero-spread group with ``drop_zero_spread_groups`` (such a
    group's advantages are all 0: it adds only KL gradient; flow_grpo drops it)."""

    @dataclass
    class Config:
        """``drop_zero_spread_groups``: leave out groups whose rewards are all equal."""

        drop_zero_spread_groups: bool = False

    def __init__(self, cfg: "AllSamples.Config"):
        self.cfg = cfg

    def __call__(self, total: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, zero_spread: torch.Tensor,
                 group_ids: torch.Tensor) -> torch.Tensor:
        return valid & ~zero_spread if self.cfg.drop_zero_spread_groups else valid
