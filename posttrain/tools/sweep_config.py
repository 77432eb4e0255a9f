"""The sweep's configuration: arms, tasks, prepare steps, the sweep file's :class:`SweepConfig`, and where
each (task, arm, seed) run keeps its folder and probe rows (shared by :mod:`posttrain.tools.sweep` and
:mod:`posttrain.tools.sweep_report`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.eval.probe import ProbeConfig
from posttrain.stages import STAGES, get_stage
from pretrain.config import ConfigError, load_config

OPEN_ENDED = 1_000_000  # train.steps of a swept run: the budget stops it


@dataclass
class ArmConfig:
    """One algorithm: ``command`` a post-training stage (grpo, dpo), ``config`` its YAML file,
    ``overrides`` dotted overrides applied after it (before the task's); ``budget_s`` (> 0) replaces the
    sweep's training seconds for this arm's runs (0: the sweep's ``budget_s``)."""

    command: str = "grpo"
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    budget_s: float = 0.0


@dataclass
class TaskConfig:
    """What the arms are trained and judged on: ``overrides`` set the training rewards (e.g.
    ``["~rewards", "rewards={jpeg_compressibility: 1.0}"]``), ``reward`` the held-out reward of the
    report (an eval entry ``NAME`` or ``NAME@PATH``), ``guard_reward`` a second held-out reward the
    arms are not trained on. ``command_overrides``: stage command -> overrides that replace
    ``overrides`` for the arms of that command (e.g. a ``reward_gradient`` arm's one differentiable
    ``reward`` where the RL arms set ``rewards``). ``trained_reward`` (optional): a learned reward some
    arms train on (an eval entry), probed too, so the report puts its gain beside ``reward``'s: the
    hacking gap."""

    reward: str = "jpeg_compressibility"
    guard_reward: str = ""
    trained_reward: str = ""
    overrides: list[str] = field(default_factory=list)
    command_overrides: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class PrepareStep:
    """A ``posttrain`` command run before the arms when ``creates`` does not exist (e.g. the pretrain
    export, or a reward model): ``command``, ``config``, ``overrides``."""

    command: str = "pretrain"
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    creates: str = ""


@dataclass
class SweepConfig:
    """``pretrained``: the export every arm starts from; ``prepare``: commands that make it (and any
    reward model) when missing; ``arms`` and ``tasks`` by name; ``seeds`` (each arm's ``train.seed``);
    ``budget_s`` training seconds per run; ``eval_every_s`` between probes; ``baseline``: the arm whose
    final held-out reward the others race to; ``run_tasks`` / ``run_arms``: run only these (None =
    all); ``probe``: the held-out evaluation (:class:`posttrain.eval.probe.ProbeConfig`)."""

    run_dir: str = "runs/sweep"
    pretrained: str = ""
    prepare: list[PrepareStep] = field(default_factory=list)
    arms: dict[str, ArmConfig] = field(default_factory=dict)
    tasks: dict[str, TaskConfig] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    budget_s: float = 150.0
    eval_every_s: float = 50.0
    baseline: str = "flow_grpo"
    run_tasks: list[str] | None = None
    run_arms: list[str] | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def validate(self, prefix: str = "") -> None:
        if not self.pretrained:
            raise ValueError(f"{prefix}pretrained: required (the export every arm starts from)")
        if not self.arms or not self.tasks or not self.seeds:
            raise ValueError(f"{prefix}arms: a sweep needs at least one arm, one task and one seed")
        if self.baseline not in self.arms:
            raise ValueError(f"{prefix}baseline: '{self.baseline}' is not an arm ({sorted(self.arms)})")
        if self.budget_s <= 0 or self.eval_every_s <= 0:
            raise ValueError(f"{prefix}budget_s: budget_s and eval_every_s must be > 0")
        for name, arm in self.arms.items():
            if arm.budget_s < 0:
                raise ValueError(f"{prefix}arms.{name}.budget_s: {arm.budget_s} is negative (0: the sweep's budget_s)")
        for key, chosen, known in (("run_tasks", self.run_tasks, self.tasks), ("run_arms", self.run_arms, self.arms)):
            unknown = sorted(set(chosen or []) - set(known))
            if unknown:
                raise ValueError(f"{prefix}{key}: {unknown} not in {sorted(known)}")
        for i, step in enumerate(self.prepare):
            if step.command not in STAGES:
                raise ValueError(f"{prefix}prepare.{i}.command: '{step.command}' is not a stage ({sorted(STAGES)})")
        for name, task in self.tasks.items():
            if not task.reward or not task.guard_reward:
                raise ValueError(f"{prefix}tasks.{name}: reward and guard_reward are both required")

    def budget_of(self, arm: str) -> float:
        """Training seconds per run of ``arm``: its own ``budget_s`` where set, else the sweep's."""
        return self.arms[arm].budget_s or self.budget_s

    def selected(self) -> tuple[list[str], list[str]]:
        """(task names, arm names) this invocation runs, in file order."""
        return ([t for t in self.tasks if self.run_tasks is None or t in self.run_tasks],
                [a for a in self.arms if self.run_arms is None or a in self.run_arms])


def run_dir_of(cfg: SweepConfig, task: str, arm: str, seed: int) -> Path:
    return Path(cfg.run_dir) / task / arm / f"seed{seed}"


def arm_config(cfg: SweepConfig, task: str, arm: str, seed: int):
    """The stage config of one run: the arm's file and overrides, the task's (its ``command_overrides``
    for the arm's command where given), then the sweep's own
    (run folder, starting export, seed, open-ended steps, no stage-side evaluation or periodic
    checkpoints, resume). ``ConfigError`` naming the arm and task."""
    a, t = cfg.arms[arm], cfg.tasks[task]
    schema, _ = get_stage(a.command)
    task_overrides = t.command_overrides.get(a.command, t.overrides)
    overrides = [*a.overrides, *task_overrides, f"run_dir={run_dir_of(cfg, task, arm, seed)}",
                 f"model.pretrained={cfg.pretrained}", f"train.seed={seed}", f"train.steps={OPEN_ENDED}",
                 "eval.every=0", "checkpoint.every=0", "checkpoint.resume=true"]
    try:
        return load_config(schema, a.config, overrides)
    except ConfigError as e:
        raise ConfigError(f"sweep arms.{arm} (task {task}): {e}") from e


def read_rows(path: Path) -> list[dict]:
    """The probe rows of a run (one JSON object per line); a torn last line is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
