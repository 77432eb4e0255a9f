"""Policy loss ``grpo_guard``: GRPO-Guard's regulated clipping, PPO-clip on the normalised per-step ratio
with per-step re-weighting, plus beta * KL to the reference (Wang et al. 2025, arXiv 2510.22319; the math
is :mod:`posttrain.objectives.trust_region`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.grpo.parts.reference_kl import ReferenceKLLoss, require_above_zero, require_beta
from posttrain.grpo.parts.registry import LOSSES
from posttrain.objectives.trust_region import guarded_clip_loss


@LOSSES.register("grpo_guard")
class GRPOGuard(ReferenceKLLoss):
    """loss = weighted mean over unmasked rows of max(-A r~, -A clip(r~, 1 - clip_range, 1 + clip_range)),
    r~ the normalised ratio, weights 1 / |dt| (``reweight``) + beta * KL(policy || reference)."""

    needs_old_means = True

    @dataclass
    class Config:
        """``clip_range``: PPO clip on the normalised ratio, whose log is the raw log-ratio times step_std and
        so smaller than Flow-GRPO's: on the shapes sweep (docs/results.md) it spread about +/-1e-4 where the
        raw ratio spread +/-5e-4, and a clip of 1e-3 never acted (verl-omni uses 2e-6 at SD3.5's scale);
        ``reweight``: weight each transition by 1 / |dt|; ``beta``:
        :func:`posttrain.grpo.parts.reference_kl.require_beta`."""

        clip_range: float = 1e-4
        reweight: bool = True
        beta: float = 0.0

        def validate(self, prefix: str = "") -> None:
            require_above_zero(prefix, "clip_range", self.clip_range)
            require_beta(prefix, self.beta)

    @classmethod
    def check_options(cls, options: "GRPOGuard.Config", step: str, prefix: str) -> None:
        """``reweight`` reads 1 / |dt| as (std_dev_t / step_std)^2, which holds for the ``sde`` step only
        (``cps`` and ``ddim`` draw their noise with std_dev_t itself): refused elsewhere, naming the key."""
        if options.reweight and step != "sde":
            raise ValueError(f"{prefix}reweight: the 1 / |dt| weights need rollout.step: sde (rollout.step "
                             f"'{step}' draws its noise with a std that is not std_dev_t sqrt(|dt|)); set "
                             f"{prefix}reweight=false")

    def __call__(self, new, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ref=None, *,
                 old_mean: torch.Tensor):
        loss, stats = guarded_clip_loss(new.log_prob, old_log_prob, new.mean, old_mean, new.step_std, new.std_dev_t,
                                        advantages=advantages, clip_range=self.cfg.clip_range,
                                        reweight=self.cfg.reweight, mask=mask)
        return self.with_reference_kl(loss, stats, new, ref, mask)
