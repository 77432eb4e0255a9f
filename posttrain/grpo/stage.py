"""`posttrain grpo`: Flow-GRPO (Liu et al. 2025, arXiv 2505.05470) on the shared runtime.

One iteration: sample ``prompts_per_step`` prompts x ``group_size`` rollouts, score them, compute
advantages and the selection mask, then update with the loss part's update: PPO-clip + beta * KL
over the recomputed log-probs of SDE rollouts (Flow-GRPO and its family, DDPO), or a forward-process
loss on the clean samples of ODE rollouts (DiffusionNFT, AWM, DGPO: :mod:`posttrain.grpo.forward_update`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from posttrain.grpo.actor import build_rollout_actor
from posttrain.grpo.ranks import RankLayout
from posttrain.grpo.engines import ENGINES
from posttrain.grpo.engines.config import RolloutEngineConfig
from posttrain.grpo.engines.reward_actor import RewardEngineConfig
from posttrain.grpo.update import GRPOAlgorithmConfig
from posttrain.base.data_loss import DataLoss, DataLossConfig
from posttrain.base.guard import Guard, group_diversity
from pretrain.router_load import RouterLoad
from pretrain.runtime.loop import run_stage
from posttrain.grpo.perf import PerfConfig, apply_model_options, compile_models, merge_lora_blocker, resolve_perf
from posttrain.base.run import PolicyRun
from posttrain.base.stage import PolicyStage
from posttrain.base.signal_guard import SignalGuard, nonfinite_counts
from posttrain.base.stage_config import StageConfig
from pretrain.data.dataset import require_in_memory
from pretrain.data.sampler import EpochSampler
from pretrain.models import count_parameters
from pretrain.runtime.profiling import peak_rss_mb
from pretrain.seeding import generator_for
from rewards.base import CompositeReward, check_reward_weights
from rewards.scoring import AsyncScorer
from pretrain.truncation import fractions, take_truncation_counts
from rollout.config import RolloutConfig
from rollout.sampler import Sampler


@dataclass
class GRPOConfig(StageConfig):
    """`posttrain grpo` config (the shared blocks: :class:`posttrain.base.stage_config.StageConfig`).

    A step is one **iteration**: ``rollout.prompts_per_step`` x ``rollout.group_size`` samples drawn,
    scored and trained on (``grpo.inner_epochs`` passes of ``train.batch_size`` mini-batches,
    ``train.grad_accum`` per optimizer step). ``train.steps``, ``checkpoint.every``, ``eval.every``,
    the metrics ``step`` and the checkpoint folders ``step_<N>`` all count iterations.
    ``rollout``: the sampler (:class:`rollout.config.RolloutConfig`); ``grpo``: the algorithm's
    registered parts (:class:`posttrain.grpo.update.GRPOAlgorithmConfig`); ``rewards``:
    ``{name: weight}`` (required; dict values from the command line merge into the file's, so switch
    a reward off with weight 0); ``engine``: where the rollout samples (the local ranks or Ray workers,
    :class:`posttrain.grpo.engines.config.RolloutEngineConfig`); ``reward_engine``: where the rewards are
    scored (:class:`posttrain.grpo.engines.reward_actor.RewardEngineConfig`); ``perf``: GRPO's speed options,
    which leave the numbers unchanged (:class:`posttrain.grpo.perf.PerfConfig`); ``data_loss``: the
    pre-training loss added to every mini-batch's loss (PPO-ptx; :class:`posttrain.base.data_loss.DataLossConfig`,
    ``batch_size`` random train images per mini-batch). Outputs go to ``<run_dir>/grpo/``."""

    run_dir: str = "runs/grpo"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOAlgorithmConfig = field(default_factory=GRPOAlgorithmConfig)
    rewards: dict[str, Any] = field(default_factory=dict)
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    reward_engine: RewardEngineConfig = field(default_factory=RewardEngineConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    data_loss: DataLossConfig = field(default_factory=DataLossConfig)

    #: keys of earlier versions and where they live now (named in the unknown-key error)
    moved_keys: ClassVar[dict[str, str]] = {"rollout.engine": "engine.name", **{
        f"rollout.{k}": f"engine.{k}" for k in ("workers", "num_cpus", "num_gpus", "mode", "max_staleness",
                                                 "ray_address", "weight_sync")}}

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        require_in_memory(self.data, f"{prefix}data.", "GRPO's prompt sampling")
        check_reward_weights(self.rewards)
        iteration_shape(self)
        check_engine(self)
        blocker = merge_lora_blocker(self.train.precision, distributed=False)  # several ranks: checked at start
        if self.perf.merge_lora and self.policy.lora_rank > 0 and blocker:
            raise ValueError(f"perf.merge_lora: true cannot be honoured with {blocker}; set perf.merge_lora=false")


def iteration_shape(cfg: GRPOConfig) -> tuple[int, int, int]:
    """(samples per iteration, mini-batches per epoch, optimizer steps per iteration); ``ValueError``
    naming the keys when they do not divide."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    mb, accum = cfg.train.batch_size, cfg.train.grad_accum
    if n % mb:
        raise ValueError(f"train.batch_size={mb} must divide rollout.prompts_per_step x rollout.group_size = {n}")
    if (n // mb) % accum:
        raise ValueError(f"train.grad_accum={accum} must divide the {n // mb} mini-batches per epoch")
    return n, n // mb, cfg.grpo.inner_epochs * (n // mb) // accum


def check_engine(cfg: GRPOConfig) -> None:
    """``ValueError`` naming the keys when the loss part's declarations
    (:func:`posttrain.grpo.parts.base.check_loss`: its update engine, log-probs, groups, old copy,
    the rollout engine, the launch's process count), its forward-process draws and the schedule,
    its whole-group mini-batches and ``train.batch_size``, the rollout engine, its mode and the old
    log-probs do not go together: stale samples are corrected against recomputed old log-probs.
    Reads the loss class and options only: no part is built."""
    from posttrain.grpo.forward_update import ForwardDraw
    from posttrain.grpo.parts.base import check_loss
    from rewards.base import groupwise_rewards
    from pretrain.parallel.launch import launched_world_size

    ro, eng, g = cfg.rollout, cfg.engine, cfg.grpo
    loss, options = g.loss_class()
    check_loss(loss, g.loss["name"], step=ro.step, rollout_engine=eng.name, world_size=launched_world_size())
    check_options = getattr(loss, "check_options", None)
    if check_options is not None:
        check_options(options, ro.step, "grpo.loss.")
    if isinstance(options, ForwardDraw):
        options.candidates(ro.num_inference_steps, "grpo.loss.")
    grouped = groupwise_rewards(cfg.rewards)
    if grouped and ro.batch_size % ro.group_size:
        raise ValueError(f"rollout.batch_size: reward(s) {grouped} score each sample against its prompt group, so a "
                         f"rollout batch must hold whole groups of {ro.group_size}; {ro.batch_size} is not a multiple")
    if loss.needs_groups and cfg.train.batch_size % ro.group_size:
        raise ValueError(f"train.batch_size: this loss compares the samples of a prompt group, so a mini-batch "
                         f"must hold whole groups of {ro.group_size}; {cfg.train.batch_size} is not a multiple")
    if cfg.reward_engine.engine == "ray" and eng.name != "ray":
        raise ValueError("reward_engine.engine: ray scores the rollout workers' results as they arrive; set "
                         "engine.name: ray (or reward_engine.engine: local)")
    if g.old_log_prob == "recompute" and not loss.needs_log_probs:
        raise ValueError(f"grpo.old_log_prob: recompute applies to log-prob losses, not '{g.loss['name']}'")
    if eng.mode != "sync" and g.rollout_correction.mode != "none" and g.old_log_prob != "recompute":
        raise ValueError(f"engine.mode: {eng.mode} corrects stale samples by pi_old / pi_behaviour: set "
                         f"grpo.old_log_prob: recompute (or grpo.rollout_correction.mode: none)")


LAST = ("lr", "nonfinite_total", "amp_overflows")
#: Update stats equal on every rank (agreed by the runtime), logged as they are rather than pooled.
RANK_SAME = (*LAST, "grad_norm", "skipped", "spike", "spikes_total", "adam_eps_dominated_frac")


def summarize(stats: list[dict]) -> dict:
    """Per-iteration view of per-mini-batch stats: the min of ratio_min, the max of ``*_max``, the last value
    of counters and the LR, the sum of ``skipped``, the mean otherwise."""
    out: dict = {}
    for key in {k for s in stats for k in s if isinstance(s[k], (int, float))}:
        vals = [s[key] for s in stats if key in s]
        if key == "ratio_min":
            out[key] = min(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key in LAST:
            out[key] = vals[-1]
        elif key == "skipped":
            out[key] = sum(vals)
        else:
            out[key] = sum(vals) / len(vals)
    out["nonfinite"] = next((s["nonfinite"] for s in stats if s.get("nonfinite")), "")
    return out


def reward_stats(total: torch.Tensor, raw: dict[str, torch.Tensor]) -> dict:
    """Means over the finite rewards only (NaN / inf are "not applicable"), each reward's std and its
    count of non-finite values (``reward/<name>_nonfinite``)."""
    finite = total[torch.isfinite(total)]
    out = {"reward_mean": float(finite.mean()) if finite.numel() else float("nan")}
    out.update({f"reward/{name}_nonfinite": c for name, c in nonfinite_counts(raw).items()})
    for name, r in raw.items():
        finite = r[torch.isfinite(r)]
        out[f"reward/{name}_mean"] = float(finite.mean()) if finite.numel() else float("nan")
        out[f"reward/{name}_std"] = float(finite.std(unbiased=False)) if finite.numel() else float("nan")
    return out


class GRPORun(PolicyRun):
    """One GRPO run, set up from ``cfg`` (export, data, policy, sampler, parts, runtime, resume): a stage
    of :mod:`pretrain.runtime.loop`. :meth:`train_step` is one rollout -> reward -> advantage -> update
    iteration; :meth:`finish` writes the grid and the exports. Benchmarks drive steps with
    :func:`pretrain.runtime.loop.step_once`."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.ranks = ranks = RankLayout.start_job(  # a no-op in one process
            cfg.parallel, Path(cfg.run_dir) / "flight_recorder")
        ranks.check(cfg.rollout.prompts_per_step, cfg.train.batch_size)
        self.perf = resolve_perf(cfg.perf, cfg.train.precision, ranks.distributed, cfg.policy.lora_rank > 0,
                                 cfg.parallel.untested_compile() if ranks.distributed else None)
        self.rewards = CompositeReward(cfg.rewards)  # first: a reward server that does not answer fails fast
        self.st = st = PolicyStage.setup(cfg, "grpo")
        apply_model_options(self.perf, st.model, st.policy.frozen_reference)
        ranks.shard(st.model, st.policy.frozen_reference, cfg.parallel, self.perf.compile, cfg.train.low_precision)
        meta, self.seed, ro = st.meta, cfg.train.seed, cfg.rollout
        self.shift = meta["sampling"]["shift"] if ro.shift is None else ro.shift
        self.sampler = Sampler.build(ro, st.model, st.encoder, st.device, self.shift)
        self.parts = cfg.grpo.build()
        self.update = self.parts.update(cfg.grpo, self.perf, st.policy)
        self.n, _, self.opt_per_iter = iteration_shape(cfg)
        self.prompts = EpochSampler(len(st.train_set), self.seed)
        self.scorer = AsyncScorer(self.rewards, self.perf.reward_workers)
        self.signal = SignalGuard(cfg.train.max_no_signal)
        experts = st.model.moe_layers() if hasattr(st.model, "moe_layers") else []
        self.router = RouterLoad(experts) if experts else None  # a mixture-of-experts policy's load, logged
        self.guard = Guard.for_stage(cfg.guard, st, trained=self.rewards)
        self.pretraining = DataLoss(cfg.data_loss, st, self.seed) if cfg.data_loss.weight else None
        if self.pretraining is not None:
            ranks.require_divisible("data_loss.batch_size", self.data_loss_batch(), "each rank trains its share")
        self.actor = build_rollout_actor(cfg, self.perf, policy=st.policy, sampling_model=self.sampling_model,
                                         sampler=self.sampler, codec=st.codec, prompts=st.train_set,
                                         image_size=meta["image_size"], device=st.device)
        self.engine = ENGINES.get(cfg.engine.name)(
            cfg=cfg, perf=self.perf, actor=self.actor, prompts=self.prompts, ranks=ranks, rewards=self.rewards,
            scorer=self.scorer, policy=st.policy, log=lambda line: self.logger.write(line))
        compile_models(self.perf, st.policy, st.codec, blocks=not ranks.distributed)  # torchrun: shard() did
        shape = {"rollout.group_size": ro.group_size, "rollout.prompts_per_step": ro.prompts_per_step,
                 # they set the optimizer steps per iteration, from which a resume counts iterations
                 "train.batch_size": cfg.train.batch_size, "train.grad_accum": cfg.train.grad_accum,
                 "grpo.inner_epochs": cfg.grpo.inner_epochs}
        resumed = self.start_runtime({"prompts": self.prompts, "signal": self.signal, **self.parts.stateful(),
                                      **self.update.stateful(), **self.engine.stateful()},
                                     headline=("reward_mean", "kl"), shape=shape, unit=("iteration", self.opt_per_iter))
        self.step = self.rt.step // self.opt_per_iter
        model, policy = st.model, st.policy
        self.logger.write(
            f"policy: {count_parameters(model, trainable_only=True) / 1e3:.1f} k trainable of "
            f"{count_parameters(model) / 1e6:.2f} M ({'LoRA' if policy.lora else 'full'}); rewards {cfg.rewards}; "
            f"device {st.device}" + (f"; resumed from {resumed}" if resumed else ""))
        self.logger.write(
            f"batch: {self.n} samples/iteration = {ro.prompts_per_step} prompts x group {ro.group_size}; rollout "
            f"batch {ro.batch_size}; train mini-batch {cfg.train.batch_size} x accumulation {cfg.train.grad_accum}"
            f" -> {self.opt_per_iter} optimizer steps/iteration over {cfg.grpo.inner_epochs} inner epoch(s)")
        self.logger.write(ranks.describe())
        self.start_guard()

    def sampling_model(self):
        """``with run.sampling_model() as model:`` the module the rollout samples with (the update's
        choice: the policy, its LoRA-merged copy with ``perf.merge_lora``, or the policy with the old
        weights of a forward-process loss that samples with them)."""
        return self.update.rollout_model(self.st.policy, self.rt.step)

    def train_step(self) -> dict:
        """One iteration: rollout (this rank's share), rewards gathered over ranks, advantages and the
        selection mask, the policy update. Returns the iteration's metrics."""
        cfg, ro, st, seed, it, parts = self.cfg, self.cfg.rollout, self.st, self.seed, self.step, self.parts
        t0 = time.perf_counter()
        batch = self.engine.collect(it)
        t1 = time.perf_counter()
        picked, traj, total, raw, group_ids = batch.picked, batch.traj, batch.total, batch.raw, batch.group_ids
        truncated = fractions(self.ranks.sum_counts(take_truncation_counts(self.rewards.models)))
        check_prompts = getattr(st.encoder, "check_truncation", None)  # every rank drew the same prompts
        text_truncated = check_prompts([st.train_set.captions[i] for i in picked]) if check_prompts else None
        adv, valid, zero = parts.advantage(total, raw, self.rewards.weights, group_ids,
                                           torch.as_tensor(picked, dtype=torch.long)[group_ids])
        for line in self.signal.check(it + 1, total, raw, zero):  # stops before the update, if it must
            self.logger.write(line)
        mask = parts.selection(total, adv, valid, zero, group_ids)
        adv, mask = self.ranks.local(adv, ro.group_size), self.ranks.local(mask, ro.group_size)
        t2 = time.perf_counter()
        layout = dict(transitions=self.sampler.train_transitions(seed, it),
                      mini_batch_size=cfg.train.batch_size // self.ranks.dp_size, seed=seed, iteration=it)
        if cfg.grpo.old_log_prob == "recompute":
            self.update.recompute_old_log_probs(st.policy, self.rt, traj, **layout)
        t_old = time.perf_counter()
        stats = self.update(st.policy, self.rt, traj, adv.to(st.device), mask.to(st.device), **layout,
                            dp_group=self.ranks.mesh.dp_group if self.ranks.distributed else None,
                            extra=None if self.pretraining is None else lambda mb: self.data_loss(it, mb))
        t3 = time.perf_counter()
        self.step = it = it + 1
        self.engine.trained(it)
        diversity = group_diversity(traj.images, traj.group_ids)  # this rank's groups
        if self.guard is not None:
            self.guard.observe(diversity)
        # this rank's update stats and diversity, pooled over the ranks (means by trained samples, true maxima)
        pooled = self.ranks.pool({**summarize(stats), "diversity": diversity}, float(mask.sum()), RANK_SAME)
        extra = {**{f"reward/{n}_truncated_frac": f for n, f in truncated.items()}}
        if self.router is not None:
            extra.update(self.router.pop(self.ranks.mesh.dp_group if self.ranks.distributed else None))
        if text_truncated is not None:
            extra["text_encoder_truncated_frac"] = text_truncated
        return {**reward_stats(total, raw), **pooled, **extra, "zero_spread_frac": float(zero.float().mean()),
                "samples": self.n, "samples_per_s": self.n / (t3 - t0),  # whole-iteration throughput
                **batch.metrics, "time_advantage_s": t2 - t1, "time_train_s": t3 - t_old, "peak_rss_mb": peak_rss_mb(),
                **({"time_old_log_prob_s": t_old - t2} if cfg.grpo.old_log_prob == "recompute" else {})}

    def data_loss_batch(self) -> int:
        return self.cfg.data_loss.batch_size or self.cfg.train.batch_size

    def data_loss(self, iteration: int, number: int) -> tuple[torch.Tensor, dict]:
        """The weighted pre-training loss of mini-batch ``number`` of ``iteration``: ``data_loss_batch()``
        train images drawn by (seed, "data_loss_images", iteration, number), the same on every rank, of
        which this rank takes its share; image i's draws keyed by number * batch + i."""
        b, st = self.data_loss_batch(), self.st
        g = generator_for(self.seed, "data_loss_images", iteration, number)
        idx = torch.randint(len(st.train_set), (b,), generator=g).tolist()
        lo, hi = self.ranks.share(b)
        loss = self.pretraining(st.policy.model, idx[lo:hi], iteration, [number * b + i for i in range(lo, hi)],
                                self.rt.autocast)
        return self.cfg.data_loss.weight * loss, {"data_loss": loss.item()}

    def held_out(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """A held-out grid every ``eval.every`` iterations (the final one is written by :meth:`finish`)."""
        if self.cfg.eval.every and step % self.cfg.eval.every == 0:
            with self.rt.sampling_model() as model:
                return {}, [self.grid(model.eval(), step)]
        return {}, []

    def grid(self, model: torch.nn.Module, step: int) -> Path:
        return self.ranks.grid(self.st, model, self.cfg.eval, self.seed, self.shift, f"heldout_iter_{step:05d}.png")

    def close(self) -> None:
        """The scoring threads and the rollout engine (its workers) end before the final grid."""
        self.scorer.close()
        self.engine.close()


def train(cfg: GRPOConfig) -> Path:
    """Run GRPO; returns the merged export folder (``<run>/grpo/export``; adapter in ``lora/``)."""
    return run_stage(GRPORun(cfg))
