"""Policy loss ``nft``: DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117), negative-aware fine-tuning
on the forward process; the math is :func:`posttrain.objectives.forward_losses.nft_loss`."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.objectives.forward_losses import masked_mean, nft_loss, nft_optimality, velocity_kl
from posttrain.grpo.forward_update import ForwardDraw
from posttrain.grpo.old_policy import OldDecay
from posttrain.grpo.parts.base import LossPart
from posttrain.grpo.parts.registry import LOSSES


@LOSSES.register("nft")
class NFTLoss(LossPart):
    """loss = masked mean of m (r L+ + (1 - r) L-) / beta + kl_beta * mean ||v - v_ref||^2 / D, with
    r = clip(A / m / 2 + 0.5, 0, 1) the optimality probability of each sample's advantage A and
    L+- the adaptive-weighted x0 errors of the implicit positive and negative policies mixed from the
    policy and the old copy. Rollouts are sampled with the old copy (the reference code's "old"
    adapter); it follows the policy by an EMA after every iteration. Needs no log-probs: pair it with
    ``rollout.step: ode`` (any solver)."""

    @dataclass
    class Config(ForwardDraw):
        """``beta``: the implicit policies' step size (NFT: 1.0; 0.1 for OCR); ``adv_clip_max``: m, the
        advantage that maps to r = 1 (NFT: 5, as the group advantage's clip); ``kl_beta``: weight of the
        velocity KL to the reference (NFT: 1e-4); ``old_decay``: the old copy's EMA schedule
        (:class:`posttrain.grpo.old_policy.OldDecay`); draws: :class:`posttrain.grpo.forward_update.ForwardDraw`
        (NFT: 9 of the 10 rollout sigmas, fraction 1)."""

        timesteps_per_sample: int = 4
        beta: float = 1.0
        adv_clip_max: float = 5.0
        kl_beta: float = 1.0e-4
        old_decay: OldDecay = field(default_factory=OldDecay)

        def validate(self, prefix: str = "") -> None:
            self.check_draw(prefix)
            if self.beta <= 0:
                raise ValueError(f"{prefix}beta: must be > 0, got {self.beta}")
            if self.adv_clip_max <= 0:
                raise ValueError(f"{prefix}adv_clip_max: must be > 0, got {self.adv_clip_max}")
            if self.kl_beta < 0:
                raise ValueError(f"{prefix}kl_beta: must be >= 0, got {self.kl_beta}")

    update = "forward"
    needs_log_probs = False
    keeps_old = True
    rollout_with_old = True

    def __init__(self, cfg: "NFTLoss.Config"):
        self.cfg = self.draw = cfg
        self.old_decay = cfg.old_decay
        self.needs_reference = cfg.kl_beta > 0

    def __call__(self, batch):
        c = self.cfg
        r = nft_optimality(batch.advantages, c.adv_clip_max)
        per = nft_loss(batch.velocity, batch.old_velocity(), batch.x0, batch.x_t, batch.sigma, r, beta=c.beta,
                       adv_clip_max=c.adv_clip_max)
        loss = masked_mean(per, batch.mask)
        stats = {"policy_loss": float(loss.detach()), "r_mean": float(r[batch.mask].mean()) if batch.mask.any() else 0.5}
        if c.kl_beta > 0:
            kl = masked_mean(velocity_kl(batch.velocity, batch.reference_velocity()), batch.mask)
            loss = loss + c.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
