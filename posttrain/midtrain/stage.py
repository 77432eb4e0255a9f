"""`posttrain midtrain`: supervised flow-matching fine-tuning of an export on a dataset (midtraining).

The pretraining objective, started from an export (``model.pretrained``) instead of random weights:
per sample, x_sigma = (1 - sigma) x0 + sigma eps with a seeded (eps, sigma), prompt dropout for
classifier-free guidance, and the regression of the export's recorded ``flow.objective``
(:mod:`pretrain.objective`: ``rectified_flow`` regresses the velocity eps - x0 with logit-normal
sigmas, Esser et al. 2024, arXiv 2403.03206, sec. 3.1; ``epsilon`` regresses the noise with uniform
discrete timesteps, Ho et al. 2020, arXiv 2006.11239, eq. 14). One step is
:func:`pretrain.trainer.train_step` as it is, on the stage's policy: LoRA (``policy.lora_rank`` > 0)
or full fine-tuning (``policy.lora_rank: 0``). Nothing is simplified relative to pretraining; there is
no reference model and no regulariser towards the start: the held-out loss shows the drift, and the
``guard`` block (:mod:`posttrain.base.guard`; no trained reward here) can watch independent rewards and stop.

Under ``torchrun`` it is one job, as pretraining and DPO: the policy is FSDP2-sharded,
``train.batch_size`` is the global micro-batch and each data-parallel rank trains its contiguous share
(noise keyed by the global sample index, so N ranks train what one process trains); rank 0 logs and
writes the grids and the export.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from posttrain.base.guard import Guard
from posttrain.base.compile import compile_blocks
from posttrain.base.run import PolicyRun
from posttrain.base.stage import PolicyStage, StageRanks
from posttrain.base.stage_config import StageConfig, StageEvalConfig
from pretrain.config import ConfigError, require_positive
from pretrain.data.feed import BatchFeed
from pretrain.data.latent_cache import require_codec
from pretrain.data.stream import sampler_for
from pretrain.evaluation import heldout_loss
from pretrain.models import count_parameters
from pretrain.objective import FlowConfig, get_objective, objective_sigmas
from pretrain.runtime.loop import run_stage
from pretrain.trainer import batch_arithmetic, train_step


@dataclass
class MidtrainEvalConfig(StageEvalConfig):
    """:class:`posttrain.base.stage_config.StageEvalConfig` (every ``every`` steps, and at the end: the
    held-out loss and a grid) plus ``heldout_samples``: the held-out flow-matching loss is the mean over
    the first ``heldout_samples`` held-out samples with fixed (noise, sigma) draws
    (:func:`pretrain.evaluation.heldout_loss`), so values compare across steps and with the start."""

    heldout_samples: int = 256

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "heldout_samples")


@dataclass
class MidtrainFlowConfig(FlowConfig):
    """Pretraining's :class:`pretrain.objective.FlowConfig` (sigma distribution, ``cond_dropout``: share
    of samples trained on the empty prompt, 0.1 as pretraining) with ``objective`` null by default: the
    objective the export records (``posttrain.json``; ``rectified_flow`` when it records none, e.g. a
    diffusers pipeline folder). A value that differs from the recorded one is refused at start."""

    objective: str | None = None

    def validate(self, prefix: str = "") -> None:
        if self.objective is not None:
            get_objective(self.objective, f"{prefix}objective")
        if not 0.0 <= self.cond_dropout <= 1.0:
            raise ValueError(f"{prefix}cond_dropout: must be in [0, 1], got {self.cond_dropout}")


@dataclass
class MidtrainConfig(StageConfig):
    """`posttrain midtrain` config (the shared blocks: :class:`posttrain.base.stage_config.StageConfig`). A
    step is one optimizer step over ``train.grad_accum`` micro-batches of ``train.batch_size`` samples
    (global: split over the data-parallel ranks under ``torchrun``); ``train.steps``,
    ``checkpoint.every``, ``eval.every``, the metrics ``step`` and the checkpoint folders count them.
    ``data``: the images to fine-tune on (any source with images; the held-out split gives
    ``heldout_loss``); ``flow``: :class:`MidtrainFlowConfig`; ``perf``: only ``compile`` (:class:`posttrain.base.compile.CompileConfig`).
    Outputs go to ``<run_dir>/midtrain/``."""

    run_dir: str = "runs/midtrain"
    flow: MidtrainFlowConfig = field(default_factory=MidtrainFlowConfig)
    eval: MidtrainEvalConfig = field(default_factory=MidtrainEvalConfig)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        if self.data.source == "prompts":
            raise ValueError("data.source: 'prompts' has no images to fine-tune on (use openmoji, folder or "
                             "moving_emoji)")
        if self.data.buckets:
            raise ValueError(f"{prefix}data.buckets: aspect-ratio buckets are checked against the model's sizes at "
                             f"pretraining only; midtrain an export at its own square size")


def resolve_flow(flow: FlowConfig, meta: dict, export: str | Path) -> FlowConfig:
    """``flow`` (its own class) whose ``objective`` is the export's recorded one
    (``meta["objective"]``, ``rectified_flow`` if none is recorded) when ``flow.objective`` is None.
    Raises ``ConfigError`` naming ``flow.objective`` when it is set and differs from the recorded one."""
    recorded = meta.get("objective")
    if flow.objective is not None and recorded is not None and flow.objective != recorded:
        raise ConfigError(f"flow.objective: '{flow.objective}' differs from '{recorded}', the objective "
                          f"{export} was trained with (its posttrain.json); leave flow.objective unset")
    objective = flow.objective or recorded or "rectified_flow"
    return replace(flow, objective=objective)


class MidtrainRun(PolicyRun):
    """One midtraining run, set up from ``cfg`` (export, policy, data, runtime, resume): a stage of
    :mod:`pretrain.runtime.loop`; :meth:`train_step` is one optimizer step of the pretraining objective.
    ``cfg.flow`` is resolved at start (:func:`resolve_flow`). Raises ``ConfigError`` for a
    ``model.pretrained`` that is not an export, a ``flow.objective`` that is not the export's or needs
    training timesteps the model lacks, or a ``train.batch_size`` the data-parallel degree does not divide."""

    def __init__(self, cfg: MidtrainConfig):
        self.ranks = ranks = StageRanks.start_batch_job(  # a no-op in one process
            cfg.parallel, cfg.train.batch_size,
            "the global micro-batch; each rank trains its contiguous share", Path(cfg.run_dir) / "flight_recorder")
        self.st = st = PolicyStage.setup(cfg, "midtrain")
        st.policy.frozen_reference = None  # no reference term: full fine-tuning keeps no frozen copy
        self.cfg = cfg = replace(cfg, flow=resolve_flow(cfg.flow, st.meta, cfg.model.pretrained))
        st.meta = {**st.meta, "objective": cfg.flow.objective}  # the export records what it was trained on
        try:  # e.g. epsilon on a model without discrete training timesteps
            self.train_sigmas = objective_sigmas(st.model, cfg.flow)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        n_trainable = count_parameters(st.model, trainable_only=True)
        ranks.shard(st.model, None, cfg.parallel, bool(cfg.perf.compile), cfg.train.low_precision)
        if cfg.perf.compile and not ranks.distributed:  # under torchrun shard() compiled the blocks
            compile_blocks(st.model)
        require_codec(st.train_set, st.codec)
        self.sampler = sampler_for(st.train_set, cfg.train.seed, cfg.data.shuffle_buffer, cfg.train.batch_size)
        self.feed = BatchFeed(st.train_set, self.sampler, cfg.train.batch_size, ranks.share(cfg.train.batch_size),
                              workers=cfg.data.workers, prefetch=cfg.data.prefetch, pin=st.device.type == "cuda")
        self.guard = Guard.for_stage(cfg.guard, st, trained=None)
        resumed = self.start_runtime({"sampler": self.sampler}, headline=("loss", "heldout_loss"))
        rt = self.rt
        mode = f"LoRA rank {cfg.policy.lora_rank}" if st.policy.lora else "full fine-tuning"
        self.logger.write(f"policy: {mode}, {n_trainable / 1e3:.1f} k trainable; objective {cfg.flow.objective} "
                          f"(cond_dropout {cfg.flow.cond_dropout}); data: {len(st.train_set)} train / "
                          f"{len(st.held)} held-out; ranks: {ranks.layout()}"
                          + (f"; resumed from {resumed}" if resumed else ""))
        self.logger.write(batch_arithmetic(cfg.train, len(st.train_set), ranks.dp_size))
        if rt.step == 0:  # the starting export's held-out loss, the baseline of the curve
            self.logger.log(0, {"heldout_loss": self.heldout(st.model)}, advance=False)
        self.start_guard()

    @property
    def step(self) -> int:
        return self.rt.step

    def heldout(self, model: torch.nn.Module) -> float:
        """Held-out flow-matching loss of ``model`` on the stage's held-out split (fixed draws keyed by
        ``train.seed``: :func:`pretrain.evaluation.heldout_loss`), float >= 0."""
        st, cfg = self.st, self.cfg
        was_training = model.training
        model.eval()
        try:
            return heldout_loss(model, st.codec, st.held, st.null, cfg.flow, seed=cfg.train.seed,
                                num_samples=cfg.eval.heldout_samples, device=st.device)
        finally:
            model.train(was_training)

    def close(self) -> None:
        """Stop the data loader's workers before the final grid and exports."""
        self.feed.close()

    def train_step(self) -> dict:
        """One optimizer step (:func:`pretrain.trainer.train_step`): ``loss``, ``grad_norm``, ``lr``,
        ``samples_per_s`` and the runtime's non-finite counters (``skipped``, ``nonfinite``, ...)."""
        st = self.st
        metrics = train_step(st.model, self.rt, self.feed, st.codec, null=st.null, cfg=self.cfg,
                             device=st.device, ranks=self.ranks, train_sigmas=self.train_sigmas)
        if metrics["nonfinite"]:
            self.logger.write(f"step {self.rt.step}: non-finite {metrics['nonfinite']}, optimizer step skipped "
                              f"({metrics['nonfinite_total']} so far)")
        return metrics

    def held_out(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """Every ``eval.every`` steps and at the last: ``heldout_loss`` and (but at the last, whose grid
        :meth:`finish` writes) a held-out grid."""
        e, out, media = self.cfg.eval, {}, []
        if last or (e.every and step % e.every == 0):
            with self.rt.sampling_model() as model:
                out["heldout_loss"] = self.heldout(model)
                if not last:
                    media.append(self.grid(model, step))
        return out, media

    def grid(self, model: torch.nn.Module, step: int) -> Path:
        """The held-out grid of ``model`` at ``step`` (``samples/heldout_step_<step>.png``; ``eval`` settings,
        the export's shift); written by rank 0, a collective under ``torchrun``."""
        was_training = model.training
        model.eval()
        try:
            return self.ranks.grid(self.st, model, self.cfg.eval, self.cfg.train.seed,
                                   self.st.meta["sampling"]["shift"], f"heldout_step_{step:06d}.png")
        finally:
            model.train(was_training)



def train(cfg: MidtrainConfig) -> Path:
    """Run midtraining (resuming when ``checkpoint.resume`` is set); returns the export folder
    (``<run_dir>/midtrain/export``; with LoRA the adapter is in ``lora/`` and merged into the export)."""
    return run_stage(MidtrainRun(cfg))
