"""The small base every post-training stage run shares (GRPO, DPO, midtraining): start the runtime and
its logger, save, evaluate with the guard, and finish with a grid and the exports.

A run is a :class:`pretrain.runtime.loop.StageRun`. A subclass sets ``cfg``, ``st`` (the
:class:`posttrain.base.stage.PolicyStage`), ``ranks`` (:class:`posttrain.base.stage.StageRanks`) and
``guard`` (None when off) in its constructor, then calls :meth:`PolicyRun.start_runtime` and, once its own
start-of-run lines are written, :meth:`PolicyRun.start_guard`. It writes ``train_step``, ``step`` (stage steps
done), ``grid(model, step)`` and optionally ``held_out(step, last)`` (its own held-out numbers and grids)
and ``close()`` (what it must release before the final grid, e.g. worker pools).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from posttrain.base.guard import guard_shape
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.profiling import StepProfiler
from pretrain.runtime.runtime import Runtime


class PolicyRun:
    """Shared start / save / evaluate / finish of a post-training stage run (see the module docstring)."""

    cfg: object
    st: object
    ranks: object
    guard: object | None = None
    rt: Runtime
    logger: MetricsLogger
    profiler: StepProfiler
    step: int

    def start_runtime(self, stateful: dict, *, headline: tuple[str, ...], shape: dict | None = None,
                      unit: tuple[str, int] = ("step", 1)) -> Path | None:
        """Build the runtime (optimizer; ``unit``: the stage step's name and its optimizer steps, the
        scheduler running over ``train.steps`` of them; checkpoints under ``<run>/checkpoints`` holding
        ``stateful`` and the guard), resume when ``checkpoint.resume`` (refused when ``shape``, the policy's
        and the guard's shape differ from the checkpoint's), record the resolved config (only once the
        start was accepted), then the profiler and the metrics logger from the resumed stage step
        (``headline``: the metrics its progress bar shows; rank 0 writes). Returns the checkpoint resumed
        from, or None."""
        cfg, st = self.cfg, self.st
        stateful = {**stateful, **({"reward_guard": self.guard} if self.guard is not None else {})}
        shape = {**(shape or {}), **st.policy.shape(), **guard_shape(cfg.guard), **self.ranks.model_parallel_shape()}
        self.rt = Runtime(st.model, cfg.train, cfg.optim, st.device, st.run / "checkpoints", cfg.checkpoint.keep_last,
                          stateful=stateful, total_steps=cfg.train.steps * unit[1], shape=shape, unit=unit)
        resumed = self.rt.start(cfg.checkpoint.resume)
        st.record(cfg)
        self.profiler = StepProfiler(cfg.profile, st.run / "profile")
        self.logger = MetricsLogger(st.run, cfg.train.steps, self.rt.step // unit[1], cfg.wandb,
                                    asdict(cfg), headline, enabled=self.ranks.is_main)
        return resumed

    def start_guard(self) -> None:
        """The guard's step-0 baseline (a no-op when it is off)."""
        if self.guard is not None:
            with self.rt.sampling_model() as model:
                self.guard.start(model, self.logger)

    def held_out(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """The stage's own held-out metrics and grids due at ``step`` (none by default)."""
        return {}, []

    def evaluate(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """:meth:`held_out`, then the guard's check every ``guard.every`` steps (its metrics and grids)."""
        metrics, media = self.held_out(step, last)
        if self.guard is not None:
            with self.rt.sampling_model() as model:
                checked, grids = self.guard.at_step(model, step, self.logger)
            metrics.update(checked)
            media += grids
        return metrics, media

    def grid(self, model: torch.nn.Module, step: int) -> Path:
        raise NotImplementedError

    def save(self) -> Path | None:
        """Checkpoint named by the stage step (``step_<step>``); None when the weights are not fit to save
        (:meth:`pretrain.runtime.runtime.Runtime.save`)."""
        return self.rt.save(self.step)

    def close(self) -> None:
        """Release what the run holds besides the model before its final grid (nothing by default)."""

    def finish(self) -> Path:
        """The guard's final check, the final held-out grid, ``lora/`` and the merged ``export/``; returns
        the export folder."""
        self.close()
        with self.rt.sampling_model() as final:  # the EMA's weights, when the run keeps one
            final.eval()
            if self.guard is not None:
                self.guard.finish(final, self.logger)
            grid = self.grid(final, self.step)
            self.logger.write(f"grid: {grid}")
            out = self.ranks.export(self.st, final)
        self.logger.write(f"exported {out}")
        self.logger.log_media(self.step, grid)
        self.logger.close()
        return out
