"""`posttrain pipeline CONFIG`: chain stages (pretrain -> grpo ...), each starting from the previous
stage's export, then evaluate every stage's export side by side (paired, same seeds)."""

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
    """Stages run in order under ``run_dir`` (stage outputs in ``<run_dir>/<command>/``); stage i > 0
    gets ``model.pretrained`` = stage i - 1's export. ``eval`` runs on all exports at the end."""

    run_dir: str = "runs/pipeline"
    stages: list[StageConfig] = field(default_factory=list)
    eval: EvalConfig = field(default_factory=EvalConfig)
    evaluate: bool = True
    device: str = "auto"


def run_pipeline(cfg: PipelineConfig, resume: bool = False) -> dict:
    """Run every stage, then the evaluation. Returns {"exports": [...], "eval": results or None}."""
    from pretrain.runtime.runtime import resolve_device

    if not cfg.stages:
        raise ConfigError("pipeline: 'stages' is empty")
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run / "pipeline.yaml")
    exports: list[str] = []
    for i, stage in enumerate(cfg.stages):
        try:
            schema, train = get_stage(stage.command)
        except ValueError as e:
            raise ConfigError(f"pipeline: stages.{i}.command: {e.args[0]}") from e
        overrides = [*stage.overrides, f"run_dir={cfg.run_dir}"]
        if exports:
            overrides.append(f"model.pretrained={exports[-1]}")
        if resume:
            overrides.append("checkpoint.resume=true")
        print(f"== stage {i}: {stage.command} ({stage.config})", flush=True)
        exports.append(str(train(load_config(schema, stage.config, overrides))))
    results = None
    if cfg.evaluate:
        print("== evaluation", flush=True)
        results = evaluate(exports, cfg.eval, run / "eval", device=resolve_device(cfg.device))
        print(results["table"], flush=True)
    return {"exports": exports, "eval": results}
