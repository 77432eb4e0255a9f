"""Sample selection ``best_of_n``: DanceGRPO's best-and-worst-k selection (Xue et al. 2025, arXiv
2505.07818, used for its video recipes): of each prompt group only the k samples with the highest
and the k with the lowest reward are trained; the advantages stay those of the whole group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.parts.registry import SELECTIONS


@SELECTIONS.register("best_of_n")
class BestOfN:
    """mask = valid and among the ``k`` best or the ``k`` worst finite rewards of its group (all of
    them when the group has at most 2k valid samples); ties broken by sample order. A group with zero
    spread is left out when ``drop_zero_spread_groups``."""

    @dataclass
    class Config:
        """``k``: samples kept at each end of every group; ``drop_zero_spread_groups``: as for ``all``."""

        k: int = 1
        drop_zero_spread_groups: bool = False

        def validate(self, prefix: str = "") -> None:
            if self.k < 1:
                raise ValueError(f"{prefix}k: must be >= 1, got {self.k}")

    def __init__(self, cfg: "BestOfN.Config"):
        self.cfg = cfg

    def __call__(self, total: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, zero_spread: torch.Tensor,
                 group_ids: torch.Tensor) -> torch.Tensor:
        k, mask = self.cfg.k, torch.zeros_like(valid)
        for g in torch.unique(group_ids):
            idx = torch.nonzero((group_ids == g) & valid).flatten()
            order = idx[torch.argsort(total[idx].float(), stable=True)]
            keep = order if len(order) <= 2 * k else torch.cat([order[:k], order[-k:]])
            mask[keep] = True
        return mask & ~zero_spread if self.cfg.drop_zero_spread_groups else mask
