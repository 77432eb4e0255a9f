"""`posttrain sweep CONFIG`: which algorithm reaches a reward first, on the same task and wall-clock.

A sweep file names arms (a stage command + its config + overrides), tasks (training rewards as
overrides, the held-out reward that judges them and a guard reward none is trained on), seeds and
an equal training budget per arm in seconds. Every (task, arm, seed) run starts from the same
export (``pretrained``) and trains until its budget is spent; every ``eval_every_s`` seconds of
training (at the first iteration boundary past each mark, and at the end) the in-memory model is
probed on the same held-out prompts and seeds (:mod:`posttrain.sweep_probe`), then checkpointed.
Only the training steps count against the budget (rollout, reward, update), not probes,
checkpoints or set-up. ``<run_dir>/report.md`` and ``<run_dir>/<task>.png`` are written at the end
(:mod:`posttrain.sweep_report`).

A killed sweep resumes where it stopped: finished runs are skipped, a run in progress reloads its
last checkpoint (taken at its last probe) with the training seconds and samples recorded there, and
probes past that checkpoint are dropped and redone.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.stages import get_run, get_stage
from posttrain.sweep_probe import ProbeConfig, ProbeRewards, probe, prompt_mean
from pretrain.config import ConfigError, load_config, save_config
from pretrain.export import require_export
from pretrain.runtime.loop import step_once

OPEN_ENDED = 1_000_000  # train.steps of a swept run: the budget stops it


@dataclass
class ArmConfig:
    """One algorithm: ``command`` a post-training stage (grpo, dpo), ``config`` its YAML file,
    ``overrides`` dotted overrides applied after it (before the task's)."""

    command: str = "grpo"
    config: str = ""
    overrides: list[str] = field(default_factory=list)


@dataclass
class TaskConfig:
    """What the arms are trained and judged on: ``overrides`` set the training rewards (e.g.
    ``["~rewards", "rewards={jpeg_compressibility: 1.0}"]``), ``reward`` the held-out reward of the
    report (an eval entry ``NAME`` or ``NAME@PATH``), ``guard_reward`` a second held-out reward the
    arms are not trained on."""

    reward: str = "jpeg_compressibility"
    guard_reward: str = ""
    overrides: list[str] = field(default_factory=list)


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
    all); ``probe``: the held-out evaluation (:class:`posttrain.sweep_probe.ProbeConfig`)."""

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
        for key, chosen, known in (("run_tasks", self.run_tasks, self.tasks), ("run_arms", self.run_arms, self.arms)):
            unknown = sorted(set(chosen or []) - set(known))
            if unknown:
                raise ValueError(f"{prefix}{key}: {unknown} not in {sorted(known)}")
        for name, task in self.tasks.items():
            if not task.reward or not task.guard_reward:
                raise ValueError(f"{prefix}tasks.{name}: reward and guard_reward are both required")

    def selected(self) -> tuple[list[str], list[str]]:
        """(task names, arm names) this invocation runs, in file order."""
        return ([t for t in self.tasks if self.run_tasks is None or t in self.run_tasks],
                [a for a in self.arms if self.run_arms is None or a in self.run_arms])


def run_dir_of(cfg: SweepConfig, task: str, arm: str, seed: int) -> Path:
    return Path(cfg.run_dir) / task / arm / f"seed{seed}"


def arm_config(cfg: SweepConfig, task: str, arm: str, seed: int):
    """The stage config of one run: the arm's file and overrides, the task's, then the sweep's own
    (run folder, starting export, seed, open-ended steps, no stage-side evaluation or periodic
    checkpoints, resume). ``ConfigError`` naming the arm and task."""
    a, t = cfg.arms[arm], cfg.tasks[task]
    schema, _ = get_stage(a.command)
    overrides = [*a.overrides, *t.overrides, f"run_dir={run_dir_of(cfg, task, arm, seed)}",
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


def run_one(cfg: SweepConfig, task: str, arm: str, seed: int, rewards: ProbeRewards, log=print) -> dict:
    """Train one (task, arm, seed) run to its budget with probes; returns its summary (``done.json``)."""
    out = run_dir_of(cfg, task, arm, seed)
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    stage_cfg = arm_config(cfg, task, arm, seed)
    stage = get_run(cfg.arms[arm].command, f"arms.{arm}.command")(stage_cfg)
    rows_path = out / "probes.jsonl"
    rows = [r for r in read_rows(rows_path) if r["iteration"] <= stage.step]  # past the checkpoint: redone
    write_rows(rows_path, rows)

    def record(elapsed: float, seen: int) -> None:
        t0 = time.perf_counter()
        row = {"iteration": stage.step, "train_s": elapsed, "samples": seen,
               **probe(stage.rt.sampling_model(), stage.st, cfg.probe, rewards)}
        rows.append(row)
        write_rows(rows_path, rows)
        if stage.step:
            stage.save()
        log(f"[{task}/{arm}/seed{seed}] {elapsed:6.1f} s, iteration {stage.step}, {seen} samples: "
            f"{rewards.reward} {prompt_mean(row['reward']):+.4f}, guard loss {row['guard_loss']:.4f}, "
            f"{rewards.guard} {prompt_mean(row['guard_reward']):+.4f} (probe {time.perf_counter() - t0:.1f} s)")

    if not rows:
        record(0.0, 0)
    elapsed, seen = rows[-1]["train_s"], rows[-1]["samples"]
    mark = cfg.eval_every_s * (math.floor(elapsed / cfg.eval_every_s + 1e-9) + 1)
    while elapsed < cfg.budget_s:
        t0 = time.perf_counter()
        metrics = step_once(stage)
        elapsed += time.perf_counter() - t0
        seen += int(metrics.get("samples", 0))
        if elapsed >= mark or elapsed >= cfg.budget_s:
            record(elapsed, seen)
            mark = cfg.eval_every_s * (math.floor(elapsed / cfg.eval_every_s + 1e-9) + 1)
    export = stage.finish()
    summary = {"iterations": stage.step, "train_s": elapsed, "samples": seen, "export": str(export)}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(done)
    return summary


def prepare(cfg: SweepConfig, log=print) -> None:
    """Run each ``prepare`` step whose ``creates`` path is missing (resuming its own checkpoints)."""
    from posttrain.cli import main

    for i, step in enumerate(cfg.prepare):
        if step.creates and Path(step.creates).exists():
            continue
        log(f"prepare {i}: posttrain {step.command} {step.config} {' '.join(step.overrides)}")
        resume = ["--resume"] if step.command in ("pretrain", "grpo", "dpo") else []
        rc = main([step.command, step.config, *step.overrides, *resume])
        if rc != 0 or (step.creates and not Path(step.creates).exists()):
            raise RuntimeError(f"sweep prepare.{i}: `posttrain {step.command} {step.config}` failed (exit {rc})"
                               + (f" or did not create {step.creates}" if step.creates else ""))


def run_sweep(cfg: SweepConfig, log=print) -> Path:
    """Prepare, check every run's config, run what is not done, write the report; returns ``report.md``."""
    from posttrain.sweep_report import write_report

    root = Path(cfg.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, root / "sweep.yaml")
    prepare(cfg, log)
    require_export(cfg.pretrained)
    tasks, arms = cfg.selected()
    for task in tasks:  # every config loads before anything trains
        for arm in arms:
            arm_config(cfg, task, arm, cfg.seeds[0])
    for task in tasks:
        t = cfg.tasks[task]
        rewards = ProbeRewards(t.reward, t.guard_reward).build()
        for arm in arms:
            for seed in cfg.seeds:
                summary = run_one(cfg, task, arm, seed, rewards, log)
                log(f"[{task}/{arm}/seed{seed}] done: {summary['iterations']} steps, {summary['samples']} samples "
                    f"in {summary['train_s']:.0f} s of training")
    return write_report(cfg)
