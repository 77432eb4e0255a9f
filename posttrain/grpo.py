"""`posttrain grpo`: Flow-GRPO (Liu et al. 2025, arXiv 2505.05470) on the shared runtime.

One iteration: sample ``prompts_per_step`` prompts x ``group_size`` SDE rollouts with log-probs,
score them, compute group advantages, then PPO-clip + beta * KL updates over the buffer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pretrain.config import require_positive

from posttrain.advantages import group_advantages, per_reward_advantages
from posttrain.distributed_grpo import RankLayout
from posttrain.grpo_update import GRPOLossConfig, grpo_update
from posttrain.perf import PerfConfig, compile_blocks, records_uncond
from posttrain.policy import PolicyConfig
from posttrain.stage import PolicyStage
from pretrain.data.dataset import DataConfig, EpochSampler
from pretrain.models import ModelConfig, count_parameters
from pretrain.parallel.config import ParallelConfig
from pretrain.runtime.config import CheckpointConfig, OptimConfig, RuntimeConfig, WandbConfig
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.profiling import ProfileConfig, StepProfiler, peak_rss_mb
from pretrain.runtime.runtime import Runtime
from pretrain.seeding import generator_for
from rewards.base import CompositeReward, check_reward_weights
from rewards.scoring import AsyncScorer
from rollout.collect import TimedCodec, collect_rollouts
from rollout.trajectory import train_timesteps


@dataclass
class RolloutConfig:
    """SDE sampling for training: ``num_inference_steps`` (Flow-GRPO trains with 10), ``noise_level``
    (0.7; 0 = the ODE), CFG ``guidance_scale`` (also used when recomputing log-probs), schedule
    ``shift``; ``prompts_per_step`` x ``group_size`` samples per iteration, sampled ``batch_size`` at a
    time; ``timestep_fraction`` of transitions trained, ``timestep_selection`` "first" or "random"
    (one random subset per iteration, shared by its samples); ``shared_initial_noise``: every sample of
    a prompt group starts from the same initial noise (DanceGRPO), so rewards within a group differ
    only through the SDE noise the log-probs credit."""

    num_inference_steps: int = 10
    noise_level: float = 0.7
    guidance_scale: float = 4.0
    shift: float | None = None
    prompts_per_step: int = 8
    group_size: int = 8
    batch_size: int = 32
    timestep_fraction: float = 0.99
    timestep_selection: str = "first"
    shared_initial_noise: bool = False

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "num_inference_steps", "prompts_per_step", "batch_size")
        if self.group_size < 2:
            raise ValueError(f"{prefix}group_size: must be >= 2 (group advantages of one sample are 0)")
        if self.noise_level <= 0:
            raise ValueError(f"{prefix}noise_level: must be > 0 (0 is the deterministic ODE: no log-prob, "
                             f"nothing to train)")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"{prefix}timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")
        if self.timestep_selection not in ("first", "random"):
            raise ValueError(f"{prefix}timestep_selection: '{self.timestep_selection}' is not one of first, random")


@dataclass
class GRPOEvalConfig:
    """Held-out grids every ``every`` iterations (0 = only at the end)."""

    every: int = 0
    grid_prompts: int = 16
    num_inference_steps: int = 20
    guidance_scale: float = 4.0


@dataclass
class GRPOConfig:
    """`posttrain grpo` config. ``model.pretrained``: an export folder (from `posttrain pretrain` or a
    previous stage); the other ``model`` fields and ``data.size`` are taken from the export.
    ``train.steps``: iterations; ``train.batch_size``: training mini-batch (samples);
    ``train.grad_accum``: mini-batches per optimizer step; ``checkpoint.every`` counts iterations (the
    folders are named by optimizer step). ``rewards``: ``{name: weight}`` (required; dict values from
    the command line merge into the file's, so switch a reward off with weight 0).
    ``rollout.shift``: None takes the export's sampling shift. ``perf``: speed options that leave the
    algorithm unchanged (:class:`posttrain.perf.PerfConfig`); ``profile.steps``: iterations to trace
    (``<run>/grpo/profile/``). ``parallel``: degrees and FSDP2 options under ``torchrun``
    (:mod:`posttrain.distributed_grpo`). Outputs go to ``<run_dir>/grpo/``."""

    run_dir: str = "runs/grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    rewards: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: GRPOEvalConfig = field(default_factory=GRPOEvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self, prefix: str = "") -> None:
        if not self.model.pretrained:
            raise ValueError("model.pretrained: required (an export folder written by `posttrain pretrain`)")
        check_reward_weights(self.rewards)
        iteration_shape(self)


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


LAST = ("lr", "nonfinite_total", "amp_overflows")


def summarize(stats: list[dict]) -> dict:
    """Per-iteration view of per-mini-batch stats: min / max for ratio_min / ratio_max, the last value
    of counters and the LR, the sum of ``skipped``, the mean otherwise."""
    out: dict = {}
    for key in {k for s in stats for k in s if isinstance(s[k], (int, float))}:
        vals = [s[key] for s in stats if key in s]
        if key == "ratio_min":
            out[key] = min(vals)
        elif key == "ratio_max":
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
    out = {"reward_mean": float(total.nanmean())}
    for name, r in raw.items():
        finite = r[torch.isfinite(r)]
        out[f"reward/{name}_mean"] = float(finite.mean()) if finite.numel() else float("nan")
        out[f"reward/{name}_std"] = float(finite.std(unbiased=False)) if finite.numel() else float("nan")
    return out


class GRPORun:
    """One GRPO run, set up from ``cfg`` (export, data, policy, runtime, resume); :meth:`iteration`
    does one rollout -> reward -> advantage -> update round and returns its metrics; :meth:`finish`
    writes the grid and the exports. ``train`` = loop + finish; benchmarks drive iterations directly."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.ranks = ranks = RankLayout.start_job(cfg.parallel)  # a no-op in one process
        ranks.check(cfg.rollout.prompts_per_step, cfg.train.batch_size, cfg.train.ema_decay)
        self.st = st = PolicyStage.setup(cfg, "grpo")
        ranks.shard(st.model, st.policy.frozen_reference, cfg.parallel, cfg.perf.compile)
        meta, self.seed = st.meta, cfg.train.seed
        self.ro = ro = replace(cfg.rollout, shift=meta["sampling"]["shift"] if cfg.rollout.shift is None
                               else cfg.rollout.shift)
        self.n, _, self.opt_per_iter = iteration_shape(cfg)
        self.prompts = EpochSampler(len(st.train_set), self.seed)
        self.rewards = CompositeReward(cfg.rewards)
        self.scorer = AsyncScorer(self.rewards, cfg.perf.reward_workers)
        # Under autocast, merged weights round differently from base + adapter: the first ratio would drift.
        self.perf = replace(cfg.perf, merge_lora=cfg.perf.merge_lora and cfg.train.precision == "fp32")
        if ranks.distributed:  # the merged copy would deep-copy sharded weights; shard() compiled the blocks
            self.perf = replace(self.perf, merge_lora=False, compile=False)
        if self.perf.compile:  # the merged copy is made (deep-copied) before anything is compiled
            merged = st.policy.inference_model(-1) if self.perf.merge_lora and st.policy.lora else None
            for m in (st.model, merged):
                if m is not None:
                    compile_blocks(m)
        self.rt = rt = Runtime(st.model, cfg.train, cfg.optim, st.device, st.run / "checkpoints",
                               cfg.checkpoint.keep_last, stateful={"prompts": self.prompts},
                               total_steps=cfg.train.steps * self.opt_per_iter)
        resumed = rt.start(cfg.checkpoint.resume)
        self.it = rt.step // self.opt_per_iter
        self.sigmas = st.model.sigmas(ro.num_inference_steps, ro.shift)
        self.latent_shape = st.codec.latent_shape(meta["image_size"], meta["image_size"])
        self.profiler = StepProfiler(cfg.profile, st.run / "profile")
        self.logger = MetricsLogger(st.run, cfg.train.steps, self.it, cfg.wandb, asdict(cfg), ("reward_mean", "kl"),
                                    enabled=ranks.is_main)
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

    def sampler(self) -> torch.nn.Module:
        """The module the rollout samples with: the policy, or its LoRA-merged copy (``perf.merge_lora``)."""
        policy = self.st.policy
        return policy.inference_model(self.rt.step) if self.perf.merge_lora else policy.model

    def advantages(self, total: torch.Tensor, raw: dict, group_ids: torch.Tensor):
        if self.cfg.grpo.reward_aggregation == "advantages":
            return per_reward_advantages(raw, self.rewards.weights, group_ids, self.cfg.grpo.adv_clip_max)
        return group_advantages(total, group_ids, self.cfg.grpo.adv_clip_max)

    def iteration(self) -> dict:
        cfg, ro, st, rt, seed, it = self.cfg, self.ro, self.st, self.rt, self.seed, self.it
        with self.profiler.step(it + 1):
            t0 = time.perf_counter()
            sampler, codec = self.sampler().eval(), TimedCodec(st.codec)
            st.model.eval()
            # every rank draws the same prompts and samples its share, noise keyed by global sample index
            mine, offset = self.ranks.prompt_share(self.prompts.next(ro.prompts_per_step), ro.group_size)
            with rt.autocast():  # the same precision as the update, so the ratio starts at 1
                traj = collect_rollouts(sampler, codec, st.train_set, mine,
                                        ro.group_size, ro.batch_size, st.null, self.sigmas, ro.noise_level,
                                        ro.guidance_scale, self.latent_shape, seed, it, st.device, offset,
                                        on_batch=lambda b: self.scorer.submit(b.images, b.prompts,
                                                                              {"sample_ids": b.sample_ids}),
                                        shared_initial_noise=ro.shared_initial_noise,
                                        record_uncond=records_uncond(self.perf, cfg.grpo.detach_uncond,
                                                                     ro.guidance_scale))
            t1 = time.perf_counter()
            total, raw, group_ids = self.ranks.gather(*self.scorer.gather(), traj.group_ids)  # all ranks' samples
            adv, valid, zero = self.advantages(total, raw, group_ids)
            mask = valid & ~zero if cfg.grpo.drop_zero_spread_groups else valid
            adv, mask = self.ranks.local(adv, ro.group_size), self.ranks.local(mask, ro.group_size)
            t2 = time.perf_counter()
            ts = train_timesteps(ro.num_inference_steps, ro.timestep_fraction, ro.timestep_selection,
                                 generator_for(seed, "train", it))
            stats = grpo_update(st.policy, rt, traj, adv.to(st.device), mask.to(st.device), st.null, cfg.grpo, ts,
                                cfg.train.batch_size // self.ranks.dp_size, ro.guidance_scale, ro.noise_level,
                                seed, it, self.perf, self.ranks.mesh.dp_group if self.ranks.distributed else None)
            t3 = time.perf_counter()
        self.it = it = it + 1
        if bool(zero.all()):
            self.logger.write(f"iteration {it}: every group has zero reward spread: no learning signal")
        metrics = {**reward_stats(total, raw), **summarize(stats), "zero_spread_frac": float(zero.float().mean()),
                   "samples_per_s": self.n / (t3 - t0),  # whole-iteration throughput
                   "time_rollout_s": t1 - t0 - codec.seconds, "time_decode_s": codec.seconds,
                   "time_reward_wait_s": self.scorer.wait_seconds, "time_advantage_s": t2 - t1,
                   "time_train_s": t3 - t2, "peak_rss_mb": peak_rss_mb()}
        self.logger.log(it, metrics)
        if cfg.eval.every and it % cfg.eval.every == 0:
            grid = self.ranks.grid(st, rt.sampling_model().eval(), cfg.eval, seed, ro.shift,
                                   f"heldout_iter_{it:05d}.png")
            self.logger.log_media(it, grid)
        if it == cfg.train.steps or (cfg.checkpoint.every and it % cfg.checkpoint.every == 0):
            rt.save()
        return metrics

    def finish(self) -> Path:
        """Final held-out grid, ``lora/`` and the merged ``export/``; returns the export folder."""
        self.scorer.close()
        final = self.rt.sampling_model().eval()
        grid = self.ranks.grid(self.st, final, self.cfg.eval, self.seed, self.ro.shift,
                               f"heldout_iter_{self.it:05d}.png")
        self.logger.write(f"grid: {grid}")
        out = self.ranks.export(self.st, final)
        self.logger.write(f"exported {out}")
        self.logger.log_media(self.it, grid)
        self.logger.close()
        return out


def train(cfg: GRPOConfig) -> Path:
    """Run GRPO; returns the merged export folder (``<run>/grpo/export``; adapter in ``lora/``)."""
    run = GRPORun(cfg)
    while run.it < cfg.train.steps:
        run.iteration()
    return run.finish()
