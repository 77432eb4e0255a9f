"""`posttrain dpo`: Diffusion-DPO (Wallace et al. 2023) for flow-matching models on the shared runtime.

Pairs come from a local Pick-a-Pic-schema dataset (``source: offline``) or from the current policy
(``source: online``: K samples per prompt, scored, best vs worst above a margin, re-sampled every
``online.resample_every`` steps). Each step draws one (noise, sigma) per pair, shared by winner and
loser, and applies :func:`posttrain.objectives.dpo_loss.diffusion_dpo_loss` on velocity errors.

Under ``torchrun`` it is one job: the policy (and a full fine-tuning reference) is FSDP2-sharded,
``train.batch_size`` is the global number of pairs per micro-batch and each data-parallel rank trains
its contiguous share (pair noise keyed by the global pair index, so N ranks train what one process
trains). Online rounds are sampled and scored identically on every rank (the same prompts and seeds:
every rank holds the whole pair set, no gather), then sliced like offline pairs; rank 0 logs and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.base.compile import compile_blocks
from posttrain.base.guard import Guard
from posttrain.base.run import PolicyRun
from posttrain.base.stage import PolicyStage, StageRanks
from posttrain.base.stage_config import StageConfig
from posttrain.dpo.sources import PAIR_SOURCES
from posttrain.dpo.step import dpo_step
from pretrain.config import require_positive
from pretrain.data.dataset import require_in_memory
from pretrain.data.sampler import EpochSampler
from pretrain.models import count_parameters
from pretrain.objective import FlowConfig
from pretrain.runtime.loop import run_stage


@dataclass
class DPOLossConfig:
    """``beta`` on velocity errors (``error_space: velocity``, default 750) or on noise-equivalent errors
    (``error_space: noise``: each velocity error is multiplied by (1 - sigma)^2, which is exactly the
    noise error of the same prediction since eps - eps_hat = (1 - sigma)(v - v_hat), so betas published
    for epsilon-prediction models, 2500 - 5000, apply as they are). The 750 default is that conversion
    on average: E[(1 - sigma)^2] is about 0.3 under logit-normal(0, 1) sigmas and 2500 x 0.3 = 750; it
    weights sigmas differently from noise-space DPO and depends on the data's scale, so treat it as a
    starting point. ``loss_type``: sigmoid | hinge | ipo. ``flow``: the sigma distribution used to noise
    pairs (logit-normal, as in pretraining; ``flow.objective: epsilon`` draws timesteps uniform over an
    epsilon-prediction model's training timesteps instead, as Diffusion-DPO does for SD; only the draw:
    the errors are those of ``error_space``) and ``flow.cond_dropout``, the share of pairs trained on the
    empty prompt (the reference code uses 0.2; default 0 here). ``sdpo_mu``: Diffusion-SDPO (Fu et al. 2025,
    arXiv 2511.03317) when set, in [0, 1]: each micro-batch's loser gradient is scaled by
    :func:`posttrain.objectives.dpo_loss.winner_preserving_scale` so that, to first order, the winners'
    error does not rise (the reference code's default is 0); None: plain Diffusion-DPO."""

    beta: float = 750.0
    loss_type: str = "sigmoid"
    error_space: str = "velocity"
    flow: FlowConfig = field(default_factory=lambda: FlowConfig(cond_dropout=0.0))
    sdpo_mu: float | None = None

    def validate(self, prefix: str = "") -> None:
        from posttrain.objectives.dpo_loss import PAIR_LOSSES

        if self.sdpo_mu is not None and not 0.0 <= self.sdpo_mu <= 1.0:
            raise ValueError(f"{prefix}sdpo_mu: must be in [0, 1] (or null: off), got {self.sdpo_mu}")

        if self.beta <= 0:
            raise ValueError(f"{prefix}beta: must be > 0, got {self.beta}")
        if self.loss_type not in PAIR_LOSSES:
            raise ValueError(f"{prefix}loss_type: '{self.loss_type}' is not one of {sorted(PAIR_LOSSES)}")
        if self.error_space not in ("velocity", "noise"):
            raise ValueError(f"{prefix}error_space: '{self.error_space}' is not one of velocity, noise")


@dataclass
class OfflineConfig:
    """``path``: parquet file, jsonl file, or a folder with ``*.parquet`` or ``pairs.jsonl``;
    ``ties``: "drop" or "half"; ``heldout_fraction`` of pairs kept aside for implicit accuracy."""

    path: str | None = None
    ties: str = "drop"
    limit: int | None = None
    heldout_fraction: float = 0.1

    def validate(self, prefix: str = "") -> None:
        if self.ties not in ("drop", "half"):
            raise ValueError(f"{prefix}ties: '{self.ties}' is not one of drop, half")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"{prefix}heldout_fraction: must be in [0, 1), got {self.heldout_fraction}")


@dataclass
class OnlineConfig:
    """``prompts_per_round`` train prompts x ``samples_per_prompt`` ODE samples every
    ``resample_every`` steps; a pair is kept when best - worst reward > ``margin``."""

    prompts_per_round: int = 32
    samples_per_prompt: int = 4
    margin: float = 0.0
    resample_every: int = 10
    num_inference_steps: int = 10
    guidance_scale: float = 4.0

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "prompts_per_round", "resample_every", "num_inference_steps")
        if self.samples_per_prompt < 2:
            raise ValueError(f"{prefix}samples_per_prompt: must be >= 2 to form a pair")
        if self.margin < 0:
            raise ValueError(f"{prefix}margin: must be >= 0 (a pair needs a reward gap above it)")


@dataclass
class DPOConfig(StageConfig):
    """`posttrain dpo` config (the shared blocks: :class:`posttrain.base.stage_config.StageConfig`). A step
    is one optimizer step: ``train.steps``, ``checkpoint.every``, ``eval.every`` (held-out implicit
    accuracy of offline pairs), the metrics ``step`` and the checkpoint folders count them.
    ``train.batch_size``: pairs per micro-batch, global (split over the data-parallel ranks under
    ``torchrun``). ``perf``: only ``compile`` (:class:`posttrain.base.compile.CompileConfig`). Outputs go to ``<run_dir>/dpo/``."""

    run_dir: str = "runs/dpo"
    source: str = "online"
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    offline: OfflineConfig = field(default_factory=OfflineConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    rewards: dict[str, Any] = field(default_factory=dict)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        require_in_memory(self.data, f"{prefix}data.", "DPO's prompt sampling")
        PAIR_SOURCES.get(self.source).check(self)


class DPORun(PolicyRun):
    """One Diffusion-DPO run, set up from ``cfg`` (export, policy, the pair source, runtime, resume): a
    stage of :mod:`pretrain.runtime.loop`; :meth:`train_step` is one optimizer step on the source's
    pairs (:mod:`posttrain.dpo.sources`: an online source re-samples them at round boundaries)."""

    def __init__(self, cfg: DPOConfig):
        self.cfg = cfg
        self.ranks = ranks = StageRanks.start_batch_job(  # a no-op in one process
            cfg.parallel, cfg.train.batch_size,
            "pairs per global micro-batch; each rank trains its contiguous share", Path(cfg.run_dir) / "flight_recorder")
        # the source first: a reward server that does not answer fails the run before any model loads
        self.source = source = PAIR_SOURCES.get(cfg.source)(cfg, ranks)
        self.st = st = PolicyStage.setup(cfg, "dpo")
        n_trainable = count_parameters(st.model, trainable_only=True)
        ranks.shard(st.model, st.policy.frozen_reference, cfg.parallel, bool(cfg.perf.compile), cfg.train.low_precision)
        if cfg.perf.compile and not ranks.distributed:  # under torchrun shard() compiled the blocks
            compile_blocks(st.model)
        self.seed = cfg.train.seed
        self.prompts = EpochSampler(len(st.train_set), self.seed)
        stateful = {"prompts": self.prompts, **source.start(st, self.prompts)}
        self.guard = Guard.for_stage(cfg.guard, st, trained=source.rewards)
        resumed = self.start_runtime(stateful, headline=("loss", "implicit_acc"))
        rt = self.rt
        self.logger.write(f"policy: {n_trainable / 1e3:.1f} k trainable; source {cfg.source}; "
                          f"beta {cfg.dpo.beta} ({cfg.dpo.loss_type}); {cfg.train.batch_size} pairs x accumulation "
                          f"{cfg.train.grad_accum} per step; ranks: {ranks.layout()}"
                          + (f"; resumed from {resumed}" if resumed else ""))
        if rt.step == 0:
            held = source.heldout(st.policy)
            if held is not None:
                self.logger.log(rt.step, held, advance=False)
        self.start_guard()

    @property
    def step(self) -> int:
        return self.rt.step

    def train_step(self) -> dict:
        st, step = self.st, self.rt.step
        pairs, sampler, metrics = self.source.pairs(step, st.model, self.rt.autocast, self.logger.write)
        metrics.update(dpo_step(st.policy, self.rt, st.codec, pairs, sampler, cfg=self.cfg, null=st.null,
                                step=step, device=st.device, ranks=self.ranks))
        return metrics

    def held_out(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """The source's held-out metrics (offline pairs' implicit accuracy) at the last step and every
        ``eval.every`` steps."""
        if last or (self.cfg.eval.every and step % self.cfg.eval.every == 0):
            return self.source.heldout(self.st.policy) or {}, []
        return {}, []

    def grid(self, model: torch.nn.Module, step: int) -> Path:
        st = self.st
        return self.ranks.grid(st, model, self.cfg.eval, self.seed, st.meta["sampling"]["shift"],
                               f"heldout_step_{step:06d}.png")


def train(cfg: DPOConfig) -> Path:
    """Run Diffusion-DPO; returns the merged export folder (``<run>/dpo/export``; adapter in ``lora/``)."""
    return run_stage(DPORun(cfg))
