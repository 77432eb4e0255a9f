"""Policy loss ``ppo_clip_kl``: Flow-GRPO's per-transition PPO-clip surrogate plus beta * KL to the
reference (Liu et al. 2025, arXiv 2505.05470, eq. 8; the math is :mod:`posttrain.objectives.ppo`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.parts.reference_kl import ReferenceKLLoss, require_above_zero, require_beta
from posttrain.grpo.parts.registry import LOSSES
from posttrain.objectives.ppo import ppo_clip_loss


@LOSSES.register("ppo_clip_kl")
class PPOClipKL(ReferenceKLLoss):
    """loss = mean over unmasked rows of max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range))
    + beta * masked mean of KL(policy || reference), r = exp(log_prob - old_log_prob)."""

    @dataclass
    class Config:
        """``clip_range``: PPO clip on the per-element-mean log-prob ratio (Flow-GRPO: 1e-4 to 1e-3);
        ``beta`` (Flow-GRPO: 0.04): :func:`posttrain.grpo.parts.reference_kl.require_beta`."""

        clip_range: float = 1e-3
        beta: float = 0.04

        def validate(self, prefix: str = "") -> None:
            require_above_zero(prefix, "clip_range", self.clip_range)
            require_beta(prefix, self.beta)

    def __call__(self, new, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ref=None):
        loss, stats = ppo_clip_loss(new.log_prob, old_log_prob, advantages, self.cfg.clip_range, mask)
        return self.with_reference_kl(loss, stats, new, ref, mask)
