"""The one stage loop every trainer runs (pretraining, GRPO, DPO and the algorithms that follow):
setup -> step -> finish.

A stage object (``PretrainRun``, ``GRPORun``, ``DPORun``, ...) is set up by its constructor (model or
export, policy, runtime, resume) and offers ``cfg`` (with ``train.steps`` and ``checkpoint.every``),
``step`` (stage steps done), ``logger``, ``profiler``, ``train_step() -> metrics`` (one step; advances
``step``), ``evaluate(step, last) -> (metrics, media)`` (held-out numbers due at this step, and the
grids written, mirrored to wandb after the step's metrics),
``save()`` and ``finish() -> export folder``.
"""

from __future__ import annotations

from pathlib import Path


def step_once(stage) -> dict:
    """One step of ``stage``: train, evaluate what is due, log, checkpoint what is due. Returns the metrics."""
    cfg = stage.cfg
    with stage.profiler.step(stage.step + 1):
        metrics = stage.train_step()
    step = stage.step
    last = step == cfg.train.steps
    held_out, media = stage.evaluate(step, last)
    metrics.update(held_out)
    stage.logger.log(step, metrics)
    for path in media:
        stage.logger.log_media(step, path)
    if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        stage.save()
    return metrics


def run_stage(stage) -> Path:
    """Run ``stage`` from where it stands (0, or a resumed step) to ``cfg.train.steps``; returns its export."""
    while stage.step < stage.cfg.train.steps:
        step_once(stage)
    return stage.finish()
