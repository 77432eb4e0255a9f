"""`posttrain pipeline CONFIG`: chain stages (pretrain -> grpo ...), each starting from the previous
stage's export, then evaluate every stage's export side by side (paired, same seeds), then write the run
report (``<run_dir>/report.md`` with plots, :mod:`posttrain.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from posttrain.evaluate import EvalConfig, evaluate
from posttrain.stages import get_stage
from pretrain.config import ConfigError, load_config, save_config


@dataclass
class StageConfig:
    """``command``: a registered stage ("pretrain", "grpo"); ``config``: its YAML file (path relative
    to the working directory); ``overrides``: dotted overrides applied after the file."""

    command: str = "pretrain"
    config: str = ""
    overrides: list[str] = field(default_factory=list)


@dataclass
class PipelineConfig:
    """Stages run in order under ``run_dir`` (stage outputs in ``<run_dir>/<command>/``, so a stage's own
    ``run_dir`` is replaced); stage i > 0 gets ``model.pretrained`` = stage i - 1's export. Every stage
    config is loaded and validated before the first one trains. ``eval`` runs on all exports at the
    end, on the first stage's data (held-out prompts and guard images)."""

    run_dir: str = "runs/pipeline"
    stages: list[StageConfig] = field(default_factory=list)
    eval: EvalConfig = field(default_factory=EvalConfig)
    evaluate: bool = True
    device: str = "auto"


def run_pipeline(cfg: PipelineConfig, resume: bool = False) -> dict:
    """Run every stage, then the evaluation, then the run report (a failure there is printed, not raised).
    Returns {"exports": [...], "eval": results or None, "report": report.md path or None}."""
    from pretrain.runtime.runtime import resolve_device

    if not cfg.stages:
        raise ConfigError("pipeline: 'stages' is empty")
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run / "pipeline.yaml")
    stages = []  # load and validate every stage up front, before any training
    for i, stage in enumerate(cfg.stages):
        try:
            schema, train = get_stage(stage.command)
        except ValueError as e:
            raise ConfigError(f"pipeline: stages.{i}.command: {e}") from e
        overrides = [*stage.overrides, f"run_dir={cfg.run_dir}"]
        if i > 0:
            overrides.append(f"model.pretrained={run / cfg.stages[i - 1].command / 'export'}")
        if resume:
            overrides.append("checkpoint.resume=true")
        try:
            stages.append((stage, train, load_config(schema, stage.config, overrides)))
        except ConfigError as e:
            raise ConfigError(f"pipeline: stages.{i} ({stage.command}): {e}") from e
    exports: list[str] = []
    for i, (stage, train, stage_cfg) in enumerate(stages):
        print(f"== stage {i}: {stage.command} ({stage.config})", flush=True)
        exports.append(str(train(stage_cfg)))
    results = None
    if cfg.evaluate:
        print("== evaluation", flush=True)
        data = getattr(stages[0][2], "data", None)  # held-out prompts and guard images of the first stage's data
        results = evaluate(exports, cfg.eval, run / "eval", device=resolve_device(cfg.device), data=data)
        print(results["table"], flush=True)
    from posttrain.report import report_after_run

    return {"exports": exports, "eval": results, "report": report_after_run(run)}
