"""Rollout correction for samples drawn by an older policy (``engine.mode: one_step_off`` / ``async``).

The rollout's log-probs are the behaviour policy's, mu (the weights a worker held when it sampled).
The PPO ratio is taken against pi_old, the policy at the start of the update, recomputed in training
(``grpo.old_log_prob: recompute``), and each stale transition's surrogate is weighted by the truncated
importance weight w = min(pi_old / mu, cap) (truncated importance sampling, Espeholt et al. 2018,
arXiv 1802.01561, eq. 1 with rho-bar = cap; verl's token-level rollout correction, one transition
being one token), or the transition is dropped when w leaves [1 / cap, cap] (``mode: reject``).
Samples drawn by the current policy (version = iterations trained) get w = 1 exactly.

The weight multiplies the advantage: for the PPO-clip surrogate max(-A r, -A clip(r)) and any w >= 0,
w * max(-A r, -A clip(r)) = max(-(w A) r, -(w A) clip(r)), so the weighted loss needs no change in the
loss part; the KL to the reference is not weighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("tis", "reject", "none")


@dataclass
class CorrectionConfig:
    """``grpo.rollout_correction``. ``mode``: ``tis`` (truncated importance weight, default), ``reject``
    (drop transitions whose weight is outside [1 / cap, cap]) or ``none`` (stale samples trained as if
    on-policy: the ratio against pi_old alone). ``cap``: the truncation / rejection bound (> 1; verl's
    default 2)."""

    mode: str = "tis"
    cap: float = 2.0

    def validate(self, prefix: str = "") -> None:
        if self.mode not in MODES:
            raise ValueError(f"{prefix}mode: '{self.mode}' is not one of {', '.join(MODES)}")
        if self.cap <= 1.0:
            raise ValueError(f"{prefix}cap: must be > 1, got {self.cap}")


def correction_weights(cfg: CorrectionConfig, old_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                       stale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row weight and keep-mask of the surrogate, both ``[k]`` (k rows of transitions).

    ``old_log_prob``: float32 ``[k]``, pi_old's (recomputed); ``behaviour_log_prob``: float32 ``[k]``,
    the rollout's; ``stale``: bool ``[k]``, rows sampled by an older policy version. Returns (float32
    weights, bool keep): 1 / True on fresh rows and with ``mode: none``; on stale rows
    min(exp(old - behaviour), cap) (``tis``) or 1 with keep = weight in [1 / cap, cap] (``reject``)."""
    ones = torch.ones_like(old_log_prob, dtype=torch.float32)
    keep = torch.ones_like(stale, dtype=torch.bool)
    if cfg.mode == "none" or not bool(stale.any()):
        return ones, keep
    w = torch.exp(old_log_prob.float().detach() - behaviour_log_prob.float())
    if cfg.mode == "tis":
        return torch.where(stale, w.clamp(max=cfg.cap), ones), keep
    inside = (w >= 1.0 / cfg.cap) & (w <= cfg.cap)
    return ones, torch.where(stale, inside, keep)


def staleness_stats(versions: torch.Tensor | None, version: int) -> dict:
    """``staleness_mean`` / ``staleness_max`` of an iteration's samples (``versions`` long ``[N]``, the
    policy version each was drawn with; None = all drawn by the current ``version``)."""
    if versions is None:
        return {"staleness_mean": 0.0, "staleness_max": 0}
    s = (version - versions).float()
    return {"staleness_mean": float(s.mean()), "staleness_max": int(s.max())}
