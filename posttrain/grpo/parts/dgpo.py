"""Policy loss ``dgpo``: DGPO (Luo et al. 2025, arXiv 2510.08425), group-level Diffusion-DPO on ODE
rollouts; the math is :func:`posttrain.objectives.forward_losses.dgpo_loss`."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.flow import flow_matching_loss
from posttrain.objectives.forward_losses import dgpo_loss, masked_mean, velocity_kl
from posttrain.grpo.forward_update import ForwardDraw
from posttrain.grpo.parts.base import LossPart
from posttrain.grpo.parts.registry import LOSSES


@LOSSES.register("dgpo")
class DGPOLoss(LossPart):
    """loss = mean over prompt groups of -log sigmoid(-s_g) (or the hinge / ipo pair loss),
    s_g = (beta / G) sum_i A_i (e_i - e_ref,i), e the flow-matching error of the policy and e_ref of
    the reference model at the same draw (shared by the group), + kl_beta * mean ||v - v_ref||^2 / D.
    Mini-batches hold whole groups. Needs no log-probs: pair it with ``rollout.step: ode``."""

    @dataclass
    class Config(ForwardDraw):
        """``beta``: the DPO temperature on the error differences (DGPO: 100 for OCR / GenEval, 10 for
        PickScore); ``loss_type``: sigmoid | hinge | ipo (the Diffusion-DPO pair losses);
        ``kl_beta``: velocity KL to the reference (DGPO: 0.02); draws:
        :class:`posttrain.grpo.forward_update.ForwardDraw` (DGPO: 4 sigmas of the noisiest half, shared by
        the group)."""

        timesteps_per_sample: int = 4
        timestep_fraction: float = 0.5
        shared_in_group: bool = True
        beta: float = 100.0
        loss_type: str = "sigmoid"
        kl_beta: float = 0.02

        def validate(self, prefix: str = "") -> None:
            from posttrain.objectives.dpo_loss import PAIR_LOSSES

            self.check_draw(prefix)
            if self.beta <= 0:
                raise ValueError(f"{prefix}beta: must be > 0, got {self.beta}")
            if self.loss_type not in PAIR_LOSSES:
                raise ValueError(f"{prefix}loss_type: '{self.loss_type}' is not one of {sorted(PAIR_LOSSES)}")
            if self.kl_beta < 0:
                raise ValueError(f"{prefix}kl_beta: must be >= 0, got {self.kl_beta}")

    update = "forward"
    needs_log_probs = False
    needs_groups = True
    needs_reference = True  # the reference's errors are half of each pair term

    def __init__(self, cfg: "DGPOLoss.Config"):
        self.cfg = self.draw = cfg

    def __call__(self, batch):
        c = self.cfg
        v_ref = batch.reference_velocity()
        err = flow_matching_loss(batch.velocity, batch.x0, batch.noise)
        ref_err = flow_matching_loss(v_ref, batch.x0, batch.noise)
        adv = batch.advantages.float() * batch.mask.float()
        loss, stats = dgpo_loss(err, ref_err, adv, batch.group_ids, c.beta, c.loss_type)
        if c.kl_beta > 0:
            kl = masked_mean(velocity_kl(batch.velocity, v_ref), batch.mask)
            loss = loss + c.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
