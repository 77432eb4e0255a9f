"""Group-relative advantages (GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3; Flow-GRPO eq. 4).

Per prompt group: A = (r - mean) / (std + 1e-4) with the population std (ddof = 0), clipped to
+/- ``adv_clip_max``. NaN-aware: a non-finite reward (NaN or +/-inf: "not applicable") is excluded
from its group's statistics and gets advantage 0 (its sample is masked out of the loss); a group with
zero spread gets 0, never NaN. Zero spread is judged relative to the rewards' scale
(:func:`has_spread`), so eight float32 rewards equal up to rounding are a zero-spread group, not a
group whose float residues become +/-3e-4 advantages.

Precision: each group's mean and std are computed in float64 by two passes (mean first, then the mean
squared deviation from it: :func:`standardize`), never as E[r^2] - E[r]^2 nor in float32, so rewards
near a large constant (1e6 + small noise) keep their spread; only the result is float32.
"""

from __future__ import annotations

import torch

EPS = 1e-4
SPREAD_RTOL = 1e-5  # ~100 float32 ulps: a std below this fraction of the rewards' magnitude is rounding


def has_spread(values: torch.Tensor, rtol: float = SPREAD_RTOL) -> bool:
    """Whether finite ``values`` (float ``[n]``) differ by more than float rounding: population std >
    ``rtol * max|values|`` (and > 0). Fewer than two values have no spread."""
    if values.numel() < 2:
        return False
    std = float(values.double().std(unbiased=False))
    return std > 0.0 and std > rtol * float(values.abs().max())


def standardize(values: torch.Tensor, ref: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """(values - mean(ref)) / (std(ref) + eps), float64 ``[n]`` for finite ``values`` ``[n]`` and ``ref``
    ``[m]`` (any float dtype), with the population std (ddof = 0) computed in float64 by two passes
    (the mean, then the mean squared deviation from it)."""
    ref = ref.double()
    mean = ref.sum() / ref.numel()
    std = ((ref - mean) ** 2).sum().div(ref.numel()).sqrt()
    return (values.double() - mean) / (std + eps)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, adv_clip_max: float = 5.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Args: ``rewards`` float ``[B]`` (NaN allowed), ``group_ids`` long ``[B]`` (same id = same prompt).

    Returns (advantages float32 ``[B]``, valid bool ``[B]`` = reward is finite, zero_spread bool
    ``[B]`` = the sample's group has no two finite rewards that differ by more than rounding:
    :func:`has_spread`)."""
    r = rewards.double()  # the group statistics in float64 (module docstring); float32 only at the end
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
        if not has_spread(vals):
            zero_spread |= members
            continue
        adv[m] = standardize(vals, vals)
    return adv.clamp(-adv_clip_max, adv_clip_max).float(), valid, zero_spread


def per_reward_advantages(raw: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                          adv_clip_max: float = 5.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-reward advantages the DanceGRPO way (Xue et al. 2025, arXiv 2505.07818): group advantages
    of each reward separately, then their weighted sum, so a reward's scale does not set its influence.

    ``raw``: ``{name: float [B]}`` (NaN = not applicable), ``weights``: ``{name: w}``. A sample's NaN
    components are skipped and the remaining weights renormalised (as :func:`rewards.base.weighted_sum`);
    returns (advantages float32 ``[B]``, valid = some reward finite, zero_spread = every reward's group
    has zero spread), like :func:`group_advantages`."""
    from rewards.base import weighted_sum

    per, valid, zero = {}, None, None
    for name, r in raw.items():
        a, v, z = group_advantages(r, group_ids, adv_clip_max)
        per[name] = torch.where(v, a, torch.full_like(a, float("nan")))
        valid = v if valid is None else valid | v
        zero = (z | ~v) if zero is None else zero & (z | ~v)
    adv = weighted_sum(per, weights)
    return torch.nan_to_num(adv, nan=0.0).clamp(-adv_clip_max, adv_clip_max), valid, zero
