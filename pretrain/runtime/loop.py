"""The one stage loop every trainer runs (pretraining, GRPO, DPO and the algorithms that follow):
setup -> step -> finish.

A stage object (``PretrainRun``, ``GRPORun``, ``DPORun``, ...) is set up by its constructor (model or
export, policy, runtime, resume) and offers ``cfg`` (with ``train.steps`` and ``checkpoint.every``),
``step`` (stage steps done), ``logger``, ``profiler``, ``train_step() -> metrics`` (one step; advances
``step``), ``evaluate(step, last) -> (metrics, media)`` (held-out numbers due at this step, and the
grids written, mirrored to wandb after the step's metrics),
``save() -> checkpoint path, or None when the weights were not fit to save`` and ``finish() -> export
folder``. A final step whose weights cannot be saved stops the run (``RunStopped``) instead of exporting
them. ``rt`` (optional) is the stage's runtime: its record of a torchrun attempt is closed with how
the stage ended (:mod:`pretrain.runtime.restarts`). A stage may also end early on purpose: when its ``guard`` (optional; None when off) has a
``stopped`` reason after a step, that step is the last one (checkpointed) and the stage finishes (exports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pretrain.runtime.guard import RunStopped


class StageRun(Protocol):
    """What :func:`run_stage` and :func:`step_once` drive (``PretrainRun``; the post-training runs through
    :class:`posttrain.base.run.PolicyRun`). ``cfg``: the stage config (``train.steps``, ``checkpoint.every``);
    ``step``: stage steps done; ``logger`` (:class:`pretrain.runtime.metrics.MetricsLogger`); ``profiler``
    (:class:`pretrain.runtime.profiling.StepProfiler`); ``rt`` (optional): the runtime; ``guard``
    (optional, None when off): a reward-hacking guard with ``stopped``."""

    cfg: Any
    step: int
    logger: Any
    profiler: Any

    def train_step(self) -> dict: ...

    def evaluate(self, step: int, last: bool) -> tuple[dict, list[Path]]: ...

    def save(self) -> Path | None: ...

    def finish(self) -> Path: ...


def step_once(stage: StageRun) -> dict:
    """One step of ``stage``: train, evaluate what is due, log, checkpoint what is due. Returns the metrics."""
    cfg = stage.cfg
    with stage.profiler.step(stage.step + 1):
        metrics = stage.train_step()
    step = stage.step
    last = step == cfg.train.steps
    held_out, media = stage.evaluate(step, last)
    last = last or bool(stopped(stage))
    metrics.update(held_out)
    stage.logger.log(step, metrics)
    for path in media:
        stage.logger.log_media(step, path)
    if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        if stage.save() is None and last:
            rt = getattr(stage, "rt", None)
            then = rt.resume_hint() if rt is not None else "--resume continues from the newest checkpoint"
            raise RunStopped(f"{rt.unit[0] if rt is not None else 'step'} {step}: the final weights are not fit to save (see the warning above), so "
                             f"nothing is exported; {then}")
    return metrics


def stopped(stage: StageRun) -> str | None:
    """The reason ``stage`` ended early (its guard's ``stopped``), or None."""
    guard = getattr(stage, "guard", None)
    return guard.stopped if guard is not None else None


def run_stage(stage: StageRun) -> Path:
    """Run ``stage`` from where it stands (0, or a resumed step) to ``cfg.train.steps``; returns its export.
    On an exception the progress bar and wandb run are ended first (wandb marks the run failed), so the
    error is the last thing printed."""
    attempt = getattr(getattr(stage, "rt", None), "attempt", None)
    try:
        while stage.step < stage.cfg.train.steps and not stopped(stage):
            step_once(stage)
        out = stage.finish()
    except BaseException as e:
        stage.logger.close(exit_code=1)
        if attempt is not None:
            attempt.end(e)
        raise
    if attempt is not None:
        attempt.end()
    return out
