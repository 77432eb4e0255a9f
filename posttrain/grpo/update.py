"""The GRPO policy update over one rollout buffer: per-transition loss (a registered part, default
PPO-clip + beta * KL), several inner epochs of shuffled mini-batches, optimizer steps through the
shared runtime. Log-probs are recomputed by :func:`rollout.sampler.log_prob` from what the
trajectory recorded; this module only decides how the CFG branches are computed (speed options)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, ClassVar, ContextManager

import torch

from posttrain.grpo.extra_loss import ExtraLoss, add_extra
from posttrain.grpo.parts.base import UPDATES, LossPart
from posttrain.grpo.perf import PerfConfig, apply_preset, no_grad_model, records_uncond
from posttrain.grpo.ranks import equal_chunks, global_count_weight
from posttrain.objectives.rollout_correction import CorrectionConfig, correction_weights
from pretrain.runtime.accumulate import Accumulation
from pretrain.seeding import generator_for
from rollout.branches import CFGBranches
from rollout.sampler import log_prob
from rollout.trajectory import Trajectory


@dataclass
class GRPOAlgorithmConfig:
    """The ``grpo:`` block. ``advantage``, ``selection`` and ``loss`` each name a registered part and
    give its options (:mod:`posttrain.grpo.parts.registry`): built in are advantages ``group`` (``clip_max``)
    ``per_reward`` (DanceGRPO) and ``per_prompt`` (DDPO's per-prompt stat tracking: ``buffer_size``,
    ``min_count``, ``clip_max``), selections ``all`` (``drop_zero_spread_groups``) and ``best_of_n``
    (``k``; DanceGRPO), losses ``ppo_clip_kl`` (``clip_range``, ``beta``) on the rollout's log-probs and
    the forward-process losses ``nft`` (DiffusionNFT), ``awm`` (Advantage Weighted Matching) and
    ``dgpo`` (DGPO), which need none (:mod:`posttrain.grpo.forward_update`). ``inner_epochs``: passes over
    the buffer per iteration;
    ``detach_uncond``: no gradient through the unconditional CFG branch (default; false = flow_grpo's
    behaviour, gradients through both branches; the loss value is the same either way).
    ``old_log_prob``: ``rollout`` (the rollout's log-probs are the PPO ratio's denominator, as
    Flow-GRPO) or ``recompute`` (pi_old recomputed in training's own batch layout and precision before
    the update, so the first ratio is 1 whatever kernels, batch size or precision the rollout ran
    with; costs one no-grad forward per trained transition). ``rollout_correction``
    (:class:`posttrain.objectives.rollout_correction.CorrectionConfig`): how samples of an older policy version are
    weighted (``engine.mode`` one_step_off / async)."""

    inner_epochs: int = 1
    detach_uncond: bool = True
    old_log_prob: str = "rollout"
    rollout_correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    advantage: dict[str, Any] = field(default_factory=lambda: {"name": "group"})
    selection: dict[str, Any] = field(default_factory=lambda: {"name": "all"})
    loss: dict[str, Any] = field(default_factory=lambda: {"name": "ppo_clip_kl"})

    def validate(self, prefix: str = "") -> None:
        """Checks the parts' names and options, and fills in each part's defaults, so the run's saved
        ``config.yaml`` records every option the parts ran with. Builds no part (a part may keep state:
        the run builds each once, :meth:`build`); the loss part's declarations are checked against the
        rollout by :func:`posttrain.grpo.parts.base.check_loss`."""
        from posttrain.grpo.parts.registry import REGISTRIES

        if self.inner_epochs < 1:
            raise ValueError(f"{prefix}inner_epochs: must be >= 1")
        if self.old_log_prob not in ("rollout", "recompute"):
            raise ValueError(f"{prefix}old_log_prob: '{self.old_log_prob}' is not one of rollout, recompute")
        for key, registry in REGISTRIES.items():
            _, options = registry.options(getattr(self, key), f"{prefix}{key}")
            if is_dataclass(options):
                setattr(self, key, {"name": getattr(self, key)["name"], **asdict(options)})

    def loss_class(self, prefix: str = "grpo.") -> tuple[type[LossPart], Any]:
        """(the class of the loss part ``loss.name`` names, its loaded options), not built; ``ValueError``
        naming the key."""
        from posttrain.grpo.parts.registry import LOSSES

        return LOSSES.options(self.loss, f"{prefix}loss")

    def build(self, prefix: str = "grpo.") -> "GRPOParts":
        """The registered parts this block names; ``ValueError`` naming the key of a bad name or option."""
        from posttrain.grpo.parts.registry import REGISTRIES

        return GRPOParts(**{key: registry.build(getattr(self, key), f"{prefix}{key}")
                            for key, registry in REGISTRIES.items()})


@dataclass
class GRPOParts:
    """The built parts of one GRPO algorithm (see :mod:`posttrain.grpo.parts.registry` for their contracts)."""

    advantage: Any
    selection: Any
    loss: LossPart

    def stateful(self) -> dict:
        """The parts that keep state across iterations (they have ``state_dict``), by checkpoint key."""
        return {f"grpo.{k}": p for k, p in vars(self).items() if hasattr(p, "state_dict")}

    def update(self, cfg: GRPOAlgorithmConfig, perf: PerfConfig | None, policy):
        """The update engine the loss names in its ``update`` (:data:`posttrain.grpo.parts.base.UPDATES`:
        :class:`GRPOUpdate` for per-transition log-probs, the forward-process update of ``nft`` /
        ``awm`` / ``dgpo``), built over these parts."""
        return UPDATES.get(self.loss.update, "grpo.loss.name")(cfg, perf, self, policy)


def transition_loss(policy, traj: Trajectory, t: int | list[int], advantages: torch.Tensor, mask: torch.Tensor,
                    *, loss, branches: CFGBranches, correction: CorrectionConfig | None = None, version: int = 0):
    """``loss`` (a registered policy loss) of a mini-batch over transition(s) ``t`` (one or a list,
    computed in one forward; the mean over k transitions equals the mean of k single-transition
    losses): the policy's recomputed steps through ``branches``, the reference model's (adapters
    disabled, or the frozen copy) when the loss needs them. The old log-probs are
    ``traj.old_log_probs`` when recomputed, else the rollout's. Samples whose ``traj.versions`` is
    below ``version`` (drawn by an older policy) are weighted by ``correction``
    (:func:`posttrain.objectives.rollout_correction.correction_weights`, folded into the advantages). Returns
    (float32 loss, stats)."""
    ts = [t] if isinstance(t, int) else list(t)
    k = len(ts)
    new = log_prob(branches, traj, ts)

    def rows(buf: torch.Tensor) -> torch.Tensor:  # [B, T] -> [k * B], transition-major like log_prob's rows
        return buf[:, ts].transpose(0, 1).reshape(-1)

    behaviour = rows(traj.log_probs)
    old = behaviour if traj.old_log_probs is None else rows(traj.old_log_probs)
    adv, keep = advantages.repeat(k), mask.repeat(k)
    extra = {}
    if correction is not None and traj.versions is not None:
        stale = (traj.versions.to(adv.device) < version).repeat(k)
        w, inside = correction_weights(correction, old, behaviour, stale)
        adv, keep = adv * w.to(adv.device), keep & inside.to(keep.device)
        if bool(stale.any()):
            extra = {"is_weight_mean": float(w[stale].mean()), "is_weight_max": float(w[stale].max()),
                     "rejected_frac": float((~inside[stale]).float().mean())}
    ref = None
    if loss.needs_reference:
        with torch.no_grad(), policy.reference() as ref_model:
            ref = log_prob(ref_model, traj, ts)
    kwargs = {}
    if loss.needs_old_means:
        if traj.means is None:
            raise ValueError(f"grpo.loss.name: {type(loss).__name__} needs the rollout's per-step means and this "
                             f"trajectory has none (a rollout that did not record them)")
        kwargs["old_mean"] = traj.means[:, ts].transpose(0, 1).reshape(-1, *traj.means.shape[2:]).to(new.mean.device)
    value, stats = loss(new, old, adv, keep, ref, **kwargs)
    return value, {**stats, **extra}


def merge_stats(acc: dict, stats: dict, weight: float) -> None:
    """Fold one chunk of transitions' stats into ``acc``: min / max for ratio_min / ratio_max, a mean
    weighted by ``weight`` (the chunk's share of the transitions) otherwise."""
    for key, v in stats.items():
        if key == "ratio_min":
            acc[key] = min(acc.get(key, v), v)
        elif key.endswith("_max"):
            acc[key] = max(acc.get(key, v), v)
        else:
            acc[key] = acc.get(key, 0.0) + v * weight


class GRPOUpdate:
    """One iteration's policy update: ``cfg`` the ``grpo:`` block, ``perf`` the speed options (same
    loss and gradients up to float rounding; ``perf.merge_lora`` resolved to a bool by the caller).
    The ``"transition"`` update engine: it provides recomputed log-probs (``supports``) and runs under
    ``torchrun``."""

    supports: ClassVar[frozenset[str]] = frozenset({"needs_log_probs", "needs_old_means"})
    distributed: ClassVar[bool] = True

    def __init__(self, cfg: GRPOAlgorithmConfig, perf: PerfConfig | None = None, parts: GRPOParts | None = None,
                 policy=None):
        self.cfg, self.perf = cfg, apply_preset(perf or PerfConfig(merge_lora=False))
        self.parts = parts or cfg.build()

    def stateful(self) -> dict:
        """State to checkpoint beyond the parts' own: none."""
        return {}

    def rollout_model(self, policy, version: int) -> ContextManager[torch.nn.Module]:
        """``with update.rollout_model(policy, version) as model:`` the module to sample rollouts with:
        the policy, or its LoRA-merged copy (``perf.merge_lora``) refreshed at ``version`` (the
        optimizer step)."""
        return nullcontext(no_grad_model(self.perf, policy, version))

    def __call__(self, policy, runtime, traj: Trajectory, advantages: torch.Tensor, mask: torch.Tensor, *,
                 transitions: list[int], mini_batch_size: int, seed: int, iteration: int, dp_group=None,
                 extra: ExtraLoss | None = None) -> list[dict]:
        """Inner epochs over ``traj`` in mini-batches shuffled by (seed, "shuffle", iteration, epoch);
        ``runtime.cfg.grad_accum`` mini-batches per optimizer step; ``advantages`` float32 ``[N]``,
        ``mask`` bool ``[N]`` (on the trajectory's device). Returns per-mini-batch stats. ``extra``: a
        term added to every mini-batch's loss (:data:`posttrain.grpo.extra_loss.ExtraLoss`; the pre-training loss).

        Until the first optimizer step the unconditional CFG branch is read from
        ``traj.uncond_velocities`` when the rollout recorded them (the weights are still the
        rollout's); the first step sets them to None on ``traj`` (they no longer hold; a second update
        over the same buffer recomputes). ``dp_group``: the data-parallel process group when this rank
        trains its share of the samples; the loss is then rescaled by dp x (local valid count) /
        (global valid count), so that the gradient FSDP averages over ranks is the mean over all
        ranks' valid samples even when ranks mask different numbers of them."""
        perf, n, acc = self.perf, len(traj), Accumulation(runtime)
        out = []
        reuse = traj.uncond_velocities is not None and records_uncond(perf, self.cfg.detach_uncond,
                                                                      traj.settings.guidance_scale)
        policy.model.train()
        for epoch in range(self.cfg.inner_epochs):
            perm = torch.randperm(n, generator=generator_for(seed, "shuffle", iteration, epoch))
            for start in range(0, n, mini_batch_size):
                number = len(out)  # the mini-batch's number in this iteration (over the inner epochs)
                idx = perm[start:start + mini_batch_size]
                mb = traj.select(idx)
                mb_stats: dict[str, float] = {}
                branches = CFGBranches(policy.model, self.cfg.detach_uncond,
                                       policy.inference_model(runtime.step) if perf.merge_lora else None,
                                       perf.uncond_in_batch, reuse)
                weight = global_count_weight(mask[idx], dp_group)
                per = perf.transitions_per_forward or len(transitions)
                for chunk, real in equal_chunks(transitions, per):  # padded: as many forwards on every rank
                    share = len(chunk) / len(transitions) if real else 0.0
                    with runtime.autocast():
                        loss, stats = transition_loss(policy, mb, chunk, advantages[idx], mask[idx],
                                                      loss=self.parts.loss, branches=branches,
                                                      correction=self.cfg.rollout_correction, version=iteration)
                    acc.backward(loss * share * weight, loss.item() * share)
                    if real:
                        merge_stats(mb_stats, stats, share)
                add_extra(acc, extra, number, mb_stats)
                stepped = acc.end_micro_batch()
                if stepped:
                    mb_stats.update(stepped)
                    reuse = False
                    traj.uncond_velocities = None  # stale from here on; frees the buffer
                out.append(mb_stats)
        return out

    @torch.no_grad()
    def recompute_old_log_probs(self, policy, runtime, traj: Trajectory, *, transitions: list[int],
                                mini_batch_size: int, seed: int, iteration: int) -> None:
        """``grpo.old_log_prob: recompute``: set ``traj.old_log_probs`` (float32 ``[B, T]``, NaN at
        transitions not in ``transitions``) to the current policy's log-probs, computed exactly as the
        first inner epoch of :meth:`__call__` will compute them (its mini-batches, transition chunks,
        CFG branches and autocast), so the first mini-batch's ratio is 1 up to autograd's effect on
        the kernels, whatever the rollout ran with. Only for log-prob losses (not the forward-process
        updates). A loss that reads the old means (``needs_old_means``) gets them recomputed with the
        log-probs, in ``traj.means``."""
        perf, n = self.perf, len(traj)
        old = torch.full_like(traj.log_probs, float("nan"), dtype=torch.float32)
        means = traj.means.clone() if self.parts.loss.needs_old_means and traj.means is not None else None
        reuse = traj.uncond_velocities is not None and records_uncond(perf, self.cfg.detach_uncond,
                                                                      traj.settings.guidance_scale)
        policy.model.train()
        perm = torch.randperm(n, generator=generator_for(seed, "shuffle", iteration, 0))
        per = perf.transitions_per_forward or len(transitions)
        for start in range(0, n, mini_batch_size):
            idx = perm[start:start + mini_batch_size]
            mb, rows = traj.select(idx), idx.to(old.device)
            branches = CFGBranches(policy.model, self.cfg.detach_uncond,
                                   policy.inference_model(runtime.step) if perf.merge_lora else None,
                                   perf.uncond_in_batch, reuse)
            for chunk, real in equal_chunks(transitions, per):
                with runtime.autocast():
                    step = log_prob(branches, mb, chunk)
                lp = step.log_prob.float().reshape(len(chunk), len(idx))
                for j, t in enumerate(chunk if real else []):
                    old[rows, t] = lp[j].to(old.device)
                    if means is not None:
                        rows_j = step.mean.float()[j * len(idx):(j + 1) * len(idx)]
                        means[rows.to(means.device), t] = rows_j.to(means.device)
        traj.old_log_probs = old
        if means is not None:
            traj.means = means
