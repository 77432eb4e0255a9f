"""`posttrain pipeline CONFIG`: chain stages (pretrain -> grpo ...), each starting from the previous
stage's export, then evaluate every stage's export side by side (paired, same seeds), then write the run
report (``<run_dir>/report.md`` with plots, :mod:`posttrain.eval.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from posttrain.eval.evaluate import EvalConfig, evaluate, with_data_overrides
from pretrain.data.dataset import source_of_folder
from posttrain.stages import STAGES, data_stages, get_stage, has_checkpoints, model_stages
from pretrain.config import ConfigError, load_config, save_config


@dataclass
class StageConfig:
    """``command``: a registered stage ("pretrain", "grpo", "curate", ...); ``config``: its YAML file (path
    relative to the working directory); ``overrides``: dotted overrides applied after the file;
    ``data_from``: an earlier data stage (e.g. "curate") whose folder dataset (``<run_dir>/<that>/data``)
    this stage trains on (``data.source=folder``, ``data.path`` set when the stage starts); ``name``: for a
    command that runs a second time (e.g. a reward model refreshed on a post-trained model's samples, then
    a second round of post-training), the stage runs with ``run_dir=<run_dir>/<name>`` and writes
    ``<run_dir>/<name>/<command>/``."""

    command: str = "pretrain"
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    data_from: str | None = None
    name: str | None = None

    def folder(self, run: Path) -> Path:
        """Where the stage writes: ``run/<command>`` or ``run/<name>/<command>``."""
        return (run / self.name if self.name else run) / self.command


@dataclass
class PipelineConfig:
    """Stages run in order under ``run_dir`` (stage outputs in ``<run_dir>/<command>/``, so a stage's own
    ``run_dir`` is replaced, and each command runs once); a stage gets ``model.pretrained`` (its row's
    ``source_key``: ``judge.generated_from`` for ``train-reward``) = the export of the last model stage
    before it (data stages such as ``curate`` write a dataset and ``train-reward`` a reward model, not a
    model export; they pass the export through: a data or reward stage first passes its own, at its
    ``source_key``). Every
    stage config is loaded and validated before the first one trains (a ``data_from`` stage with its own
    data block; its folder is read when it starts). ``eval`` runs on the model stages' exports at the end,
    on the first stage's data (held-out prompts and guard images), with ``eval.data``'s overrides."""

    run_dir: str = "runs/pipeline"
    stages: list[StageConfig] = field(default_factory=list)
    eval: EvalConfig = field(default_factory=EvalConfig)
    evaluate: bool = True
    device: str = "auto"


@dataclass
class PlannedStage:
    """One validated stage of a pipeline: its entry, schema, train function, the overrides it runs with
    (``run_dir``, ``model.pretrained`` or its row's ``source_key``, resume, and ``data_from``'s folder) and
    its config as validated."""

    stage: StageConfig
    schema: type
    train: object
    overrides: list[str]
    config: object

    def load(self):
        """The config the stage runs with (read when it starts, so a ``data_from`` folder exists)."""
        if not self.stage.data_from:
            return self.config
        folder = self.overrides[-1].partition("=")[2]  # data.path=..., the last override
        source = f"data.source={source_of_folder(folder)}"
        return load_config(self.schema, self.stage.config, [*self.overrides[:-1], source, self.overrides[-1]])


def dotted(config, key: str):
    """The value at dotted ``key`` of a loaded config (None where a part is missing)."""
    for part in key.split("."):
        config = getattr(config, part, None)
    return config


def plan(cfg: PipelineConfig, resume: bool = False) -> list[PlannedStage]:
    """Load and validate every stage of ``cfg`` before anything trains; ``ConfigError`` naming
    ``stages.<i>`` and the key."""
    if not cfg.stages:
        raise ConfigError("pipeline: 'stages' is empty")
    run, out, source = Path(cfg.run_dir), [], None  # source: the export the next stage starts from
    folders = [s.folder(run) for s in cfg.stages]
    for i, stage in enumerate(cfg.stages):
        if stage.name is not None and (not stage.name or "/" in stage.name or stage.name in (".", "..")):
            raise ConfigError(f"pipeline: stages.{i}.name: '{stage.name}' must be a plain folder name")
        if folders[i] in folders[:i]:
            raise ConfigError(f"pipeline: stages.{i}: '{stage.command}' would write {folders[i]} a second time; "
                              f"give the second one a name (stages.{i}.name), whose folder it then writes under")
    for i, stage in enumerate(cfg.stages):
        try:
            schema, train = get_stage(stage.command)
        except ValueError as e:
            raise ConfigError(f"pipeline: stages.{i}.command: {e}") from e
        overrides = [*stage.overrides, f"run_dir={run / stage.name if stage.name else cfg.run_dir}"]
        if source is not None:
            overrides.append(f"{STAGES[stage.command].source_key}={source}")
        if resume and has_checkpoints(schema):
            overrides.append("checkpoint.resume=true")
        data = []
        if stage.data_from is not None:
            earlier = [s.command for s in cfg.stages[:i]]
            if stage.data_from not in earlier or stage.data_from not in data_stages():
                raise ConfigError(f"pipeline: stages.{i}.data_from: '{stage.data_from}' is not an earlier data stage "
                                  f"(earlier: {earlier}; data stages: {data_stages()})")
            data = [f"data.path={run / stage.data_from / 'data'}"]  # the source is read from the folder at start
        try:
            loaded = load_config(schema, stage.config, overrides)
        except ConfigError as e:
            raise ConfigError(f"pipeline: stages.{i} ({stage.command}): {e}") from e
        out.append(PlannedStage(stage, schema, train, overrides + data, loaded))
        if stage.command in model_stages():
            source = stage.folder(run) / "export"
        elif source is None and dotted(loaded, STAGES[stage.command].source_key):
            source = dotted(loaded, STAGES[stage.command].source_key)  # a data or reward stage first: its export
    return out


def run_pipeline(cfg: PipelineConfig, resume: bool = False) -> dict:
    """Run every stage, then the evaluation of the model stages' exports, then the run report (a failure
    there is printed, not raised). Returns {"exports": [...], "eval": results or None, "report": report.md
    path or None}."""
    from pretrain.runtime.runtime import resolve_device

    stages = plan(cfg, resume)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run / "pipeline.yaml")
    exports: list[str] = []
    for i, planned in enumerate(stages):
        print(f"== stage {i}: {planned.stage.command} ({planned.stage.config})", flush=True)
        out = str(planned.train(planned.load()))
        if planned.stage.command in model_stages():
            exports.append(out)
    results = None
    if cfg.evaluate:
        print("== evaluation", flush=True)
        data = getattr(stages[0].config, "data", None)  # held-out prompts and guard images of the first stage's data
        if data is not None:
            data = with_data_overrides(data, cfg.eval.data, "eval.data")
        results = evaluate(exports, cfg.eval, run / "eval", device=resolve_device(cfg.device), data=data)
        print(results["table"], flush=True)
    from posttrain.eval.report import report_after_run

    return {"exports": exports, "eval": results, "report": report_after_run(run)}
