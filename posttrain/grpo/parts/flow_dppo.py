"""Policy loss ``flow_dppo``: Flow-DPPO's divergence mask in place of ratio clipping, plus beta * KL to
the reference (Ping et al. 2026, arXiv 2606.11025; the math is :mod:`posttrain.objectives.trust_region`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.parts.reference_kl import ReferenceKLLoss, require_above_zero, require_beta
from posttrain.grpo.parts.registry import LOSSES
from posttrain.objectives.trust_region import divergence_masked_loss


@LOSSES.register("flow_dppo")
class FlowDPPO(ReferenceKLLoss):
    """loss = mean over unmasked rows of -A r, a row the divergence mask blocks counting as 0, + beta *
    KL(policy || reference); the old policy's per-step means come from the rollout (``needs_old_means``;
    with a bf16 rollout and fp32 training, ``grpo.old_log_prob: recompute`` keeps kernel noise in the old
    means out of a KL compared with a 1e-5 threshold)."""

    needs_old_means = True

    @dataclass
    class Config:
        """``kl_threshold``: the per-element KL(new || old) at which a row moving further out stops
        contributing (the paper's reference code: 1e-5; Flow-Factory: 1e-6); ``beta``:
        :func:`posttrain.grpo.parts.reference_kl.require_beta`."""

        kl_threshold: float = 1e-5
        beta: float = 0.0

        def validate(self, prefix: str = "") -> None:
            require_above_zero(prefix, "kl_threshold", self.kl_threshold)
            require_beta(prefix, self.beta)

    def __call__(self, new, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ref=None, *,
                 old_mean: torch.Tensor):
        loss, stats = divergence_masked_loss(new.log_prob, old_log_prob, new.mean, old_mean, new.step_std,
                                             advantages, kl_threshold=self.cfg.kl_threshold, mask=mask)
        return self.with_reference_kl(loss, stats, new, ref, mask)
