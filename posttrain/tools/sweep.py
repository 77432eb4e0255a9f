"""`posttrain sweep CONFIG`: which algorithm reaches a reward first, on the same task and wall-clock.

A sweep file names arms (a stage command + its config + overrides), tasks (training rewards as
overrides, the held-out reward that judges them and a guard reward none is trained on), seeds and
an equal training budget per arm in seconds. Every (task, arm, seed) run starts from the same
export (``pretrained``) and trains until its budget is spent; every ``eval_every_s`` seconds of
training (at the first iteration boundary past each mark, and at the end) the in-memory model is
probed on the same held-out prompts and seeds (:mod:`posttrain.eval.probe`), then checkpointed.
Only the training steps count against the budget (rollout, reward, update), not probes,
checkpoints or set-up. ``<run_dir>/report.md`` and ``<run_dir>/<task>.png`` are written at the end
(:mod:`posttrain.tools.sweep_report`).

A killed sweep resumes where it stopped: finished runs are skipped, a run in progress reloads its
last checkpoint (taken at its last probe) with the training seconds and samples recorded there, and
probes past that checkpoint are dropped and redone.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from posttrain.eval.probe import ProbeRewards, probe, prompt_mean
from posttrain.stages import get_run, run_command
from posttrain.tools.sweep_config import PrepareStep, SweepConfig, arm_config, read_rows, run_dir_of, write_rows
from pretrain.config import save_config
from pretrain.export import require_export
from pretrain.runtime.loop import step_once

def run_one(cfg: SweepConfig, task: str, arm: str, seed: int, rewards: ProbeRewards, log=print) -> dict:
    """Train one (task, arm, seed) run to its budget with probes; returns its summary (``done.json``)."""
    out = run_dir_of(cfg, task, arm, seed)
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    stage_cfg = arm_config(cfg, task, arm, seed)
    stage = get_run(cfg.arms[arm].command, f"arms.{arm}.command")(stage_cfg)
    stage.logger.open_ended()  # the budget ends the run, not train.steps: no ETA from OPEN_ENDED steps
    rows_path = out / "probes.jsonl"
    rows = [r for r in read_rows(rows_path) if r["iteration"] <= stage.step]  # past the checkpoint: redone
    write_rows(rows_path, rows)

    def record(elapsed: float, seen: int) -> None:
        t0 = time.perf_counter()
        with stage.rt.sampling_model() as model:
            row = {"iteration": stage.step, "train_s": elapsed, "samples": seen,
                   **probe(model, stage.st, cfg.probe, rewards)}
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
    budget = cfg.budget_of(arm)
    while elapsed < budget:
        t0 = time.perf_counter()
        metrics = step_once(stage)
        elapsed += time.perf_counter() - t0
        seen += int(metrics.get("samples", 0))
        if elapsed >= mark or elapsed >= budget:
            record(elapsed, seen)
            mark = cfg.eval_every_s * (math.floor(elapsed / cfg.eval_every_s + 1e-9) + 1)
    export = stage.finish()
    summary = {"iterations": stage.step, "train_s": elapsed, "samples": seen, "export": str(export)}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(done)
    return summary


def needed(cfg: SweepConfig, step: PrepareStep) -> bool:
    """Whether a prepare step serves this invocation: one without ``creates``, one that makes the starting
    export, or one whose ``creates`` or the folder holding it (e.g. a reward model's folder) is named, as a
    whole path, by a selected task (its rewards and overrides) or a selected arm (its config and
    overrides)."""
    if not step.creates:
        return True
    tasks, arms = cfg.selected()
    named = " ".join([cfg.pretrained, *(s for t in tasks for s in (cfg.tasks[t].reward, cfg.tasks[t].guard_reward,
                                                                   cfg.tasks[t].trained_reward,
                                                                   *cfg.tasks[t].overrides)),
                      *(s for a in arms for s in (cfg.arms[a].config, *cfg.arms[a].overrides))])
    created = Path(step.creates)
    return any(re.search(re.escape(str(p)) + r"(?=$|[/\s,}\]\"'])", named) for p in (created, created.parent)
               if len(p.parts) > 1)


def run_prepare_step(step: PrepareStep) -> None:
    """One prepare step: a stage of the stage table (``train-reward`` included), run to its end (resuming
    its own checkpoints where it has them)."""
    run_command(step.command, step.config, step.overrides, resume=True)


def prepare(cfg: SweepConfig, log=print) -> None:
    """Run each ``prepare`` step whose ``creates`` path is missing (a stage of the stage table, resuming its
    own checkpoints, or ``train-reward``). ``RuntimeError`` naming ``prepare.<i>`` when a step fails or does
    not create its path."""
    for i, step in enumerate(cfg.prepare):
        if step.creates and Path(step.creates).exists():
            continue
        if not needed(cfg, step):
            log(f"prepare {i}: skipped, the selected tasks and arms do not use {step.creates}")
            continue
        log(f"prepare {i}: posttrain {step.command} {step.config} {' '.join(step.overrides)}")
        try:
            run_prepare_step(step)
        except Exception as e:
            raise RuntimeError(f"sweep prepare.{i}: `posttrain {step.command} {step.config}` failed: "
                               f"{type(e).__name__}: {e}") from e
        if step.creates and not Path(step.creates).exists():
            raise RuntimeError(f"sweep prepare.{i}: `posttrain {step.command} {step.config}` did not create "
                               f"{step.creates}")


def run_sweep(cfg: SweepConfig, log=print) -> Path:
    """Prepare, check every run's config, run what is not done, write the report; returns ``report.md``."""
    from posttrain.tools.sweep_report import write_report

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
        rewards = ProbeRewards(t.reward, t.guard_reward, t.trained_reward).build()
        for arm in arms:
            for seed in cfg.seeds:
                summary = run_one(cfg, task, arm, seed, rewards, log)
                log(f"[{task}/{arm}/seed{seed}] done: {summary['iterations']} steps, {summary['samples']} samples "
                    f"in {summary['train_s']:.0f} s of training")
    return write_report(cfg)
