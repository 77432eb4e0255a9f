"""Policy loss ``ppo_clip_kl``: Flow-GRPO's per-transition PPO-clip surrogate plus beta * KL to the
reference (Liu et al. 2025, arXiv 2505.05470, eq. 8; the math is :mod:`posttrain.objectives.ppo`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.objectives.ppo import kl_to_reference, ppo_clip_loss
from posttrain.grpo.parts.base import LossPart
from posttrain.grpo.parts.registry import LOSSES


@LOSSES.register("ppo_clip_kl")
class PPOClipKL(LossPart):
    """loss = mean over unmasked rows of max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range))
    + beta * masked mean of KL(policy || reference), r = exp(log_prob - old_log_prob)."""

    @dataclass
    class Config:
        """``clip_range``: PPO clip on the per-element-mean log-prob ratio (Flow-GRPO: 1e-4 to 1e-3);
        ``beta``: weight of the KL to the reference (Flow-GRPO: 0.04), the per-element KL of the two
        Gaussian transitions with the std the step draws its noise with (``step_std``)."""

        clip_range: float = 1e-3
        beta: float = 0.04

        def validate(self, prefix: str = "") -> None:
            if self.clip_range <= 0:
                raise ValueError(f"{prefix}clip_range: must be > 0, got {self.clip_range}")
            if self.beta < 0:
                raise ValueError(f"{prefix}beta: must be >= 0, got {self.beta}")

    def __init__(self, cfg: "PPOClipKL.Config"):
        self.cfg = cfg
        self.needs_reference = cfg.beta > 0

    def __call__(self, new, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ref=None):
        loss, stats = ppo_clip_loss(new.log_prob, old_log_prob, advantages, self.cfg.clip_range, mask)
        if self.needs_reference:
            kl = kl_to_reference(new.mean, ref.mean, new.step_std)
            w = mask.float()
            kl = (kl * w).sum() / w.sum().clamp(min=1.0)
            loss = loss + self.cfg.beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
