"""Policy loss ``awm``: Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050), the pretraining
flow-matching loss on the rollouts' clean samples weighted by advantage; the math is
:func:`posttrain.objectives.forward_losses.awm_loss`."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.objectives.forward_losses import awm_loss, masked_mean, velocity_kl
from posttrain.grpo.forward_update import ForwardDraw
from posttrain.grpo.old_policy import OldDecay
from posttrain.grpo.parts.base import LossPart
from posttrain.grpo.parts.registry import LOSSES


@LOSSES.register("awm")
class AWMLoss(LossPart):
    """loss = masked mean of (s A) ||v - (eps - x0)||^2 / D + beta * mean ||v - v_ref||^2 / D
    + ema_beta * mean ||v - v_old||^2 / D: each sample's flow-matching loss weighted by its advantage
    A (times ``advantage_scale``), a velocity KL to the reference model and one to an EMA copy of the
    policy (the reference code's "ema" adapter). Needs no log-probs: pair it with ``rollout.step: ode``."""

    @dataclass
    class Config(ForwardDraw):
        """``advantage_scale`` s (the reference code trains on clip(A, +/-5) / 5: s = 0.2 with the
        group advantage's clip_max 5); ``beta``: velocity KL to the reference (AWM: 1e-3 GenEval,
        3e-3 OCR, 1e-4 PickScore); ``ema_beta``: velocity KL to the EMA copy (AWM: 1; 0 keeps no copy);
        ``old_decay``: that copy's schedule (AWM: rate 0.001 up to 0.3); draws:
        :class:`posttrain.grpo.forward_update.ForwardDraw` (AWM: 6 sigmas of the first 80 % of 14)."""

        timesteps_per_sample: int = 4
        timestep_fraction: float = 0.8
        advantage_scale: float = 0.2
        beta: float = 1.0e-3
        ema_beta: float = 1.0
        old_decay: OldDecay = field(default_factory=lambda: OldDecay(start=0, rate=0.001, max=0.3))

        def validate(self, prefix: str = "") -> None:
            self.check_draw(prefix)
            if self.advantage_scale <= 0:
                raise ValueError(f"{prefix}advantage_scale: must be > 0, got {self.advantage_scale}")
            if self.beta < 0 or self.ema_beta < 0:
                raise ValueError(f"{prefix}beta: beta and ema_beta must be >= 0, got {self.beta}, {self.ema_beta}")

    update = "forward"
    needs_log_probs = False
    keeps_old = True

    def __init__(self, cfg: "AWMLoss.Config"):
        self.cfg = self.draw = cfg
        self.old_decay = cfg.old_decay if cfg.ema_beta > 0 else None
        self.needs_reference = cfg.beta > 0

    def __call__(self, batch):
        c = self.cfg
        loss = awm_loss(batch.velocity, batch.x0, batch.noise, c.advantage_scale * batch.advantages, batch.mask)
        stats = {"policy_loss": float(loss.detach())}
        for weight, name, other in ((c.beta, "kl", batch.reference_velocity), (c.ema_beta, "kl_old", batch.old_velocity)):
            if weight > 0:
                kl = masked_mean(velocity_kl(batch.velocity, other()), batch.mask)
                loss = loss + weight * kl
                stats[name] = float(kl.detach())
        return loss, stats
