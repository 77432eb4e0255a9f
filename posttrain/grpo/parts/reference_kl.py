"""What the per-transition losses share: the ``beta`` option and the beta * KL(policy || reference) term
(Flow-GRPO, Liu et al. 2025, arXiv 2505.05470, eq. 8), and the check of a positive option."""

from __future__ import annotations

import torch

from posttrain.grpo.parts.base import LossPart
from posttrain.objectives.ppo import masked_reference_kl


def require_above_zero(prefix: str, name: str, value: float) -> None:
    """``ValueError`` naming ``prefix + name`` unless ``value`` > 0."""
    if not value > 0:
        raise ValueError(f"{prefix}{name}: must be > 0, got {value}")


def require_beta(prefix: str, beta: float) -> None:
    """``beta``: weight of the per-element KL to the reference, the KL of the two Gaussian transitions with
    the std the step draws its noise with (``step_std``); 0: no reference is read. ``ValueError`` naming
    ``prefix + "beta"`` when it is negative."""
    if beta < 0:
        raise ValueError(f"{prefix}beta: must be >= 0, got {beta}")


class ReferenceKLLoss(LossPart):
    """A transition loss whose config has ``beta`` (:func:`require_beta`): reads the reference when it is > 0 and adds
    beta * the masked mean KL with :meth:`with_reference_kl` (logged as ``kl``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.needs_reference = cfg.beta > 0

    def with_reference_kl(self, loss: torch.Tensor, stats: dict, new, ref, mask: torch.Tensor):
        if self.needs_reference:
            kl = masked_reference_kl(new, ref, mask)
            loss = loss + self.cfg.beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
