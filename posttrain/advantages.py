"""Group-relative advantages (GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3; Flow-GRPO eq. 4).

Per prompt group: A = (r - mean) / (std + 1e-4) with the population std (ddof = 0), clipped to
+/- ``adv_clip_max``. NaN-aware: a NaN reward is excluded from its group's statistics and gets
advantage 0 (its sample is masked out of the loss); a group with zero spread gets 0, never NaN.
"""

from __future__ import annotations

import torch

EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, adv_clip_max: float = 5.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Args: ``rewards`` float ``[B]`` (NaN allowed), ``group_ids`` long ``[B]`` (same id = same prompt).

    Returns (advantages float32 ``[B]``, valid bool ``[B]`` = reward is finite, zero_spread bool
    ``[B]`` = the sample's group has fewer than two distinct finite rewards)."""
    r = rewards.float()
    valid = torch.isfinite(r)
    adv = torch.zeros_like(r)
    zero_spread = torch.zeros_like(valid)
    for g in torch.unique(group_ids):
        members = group_ids == g
        m = members & valid
        vals = r[m]
        if vals.numel() == 0:
            zero_spread |= members
            continue
        std = vals.std(unbiased=False) if vals.numel() > 1 else vals.new_zeros(())
        if float(std) == 0.0:
            zero_spread |= members
            continue
        adv[m] = (vals - vals.mean()) / (std + EPS)
    return adv.clamp(-adv_clip_max, adv_clip_max), valid, zero_spread
