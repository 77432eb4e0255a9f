"""The sweep's report: per task, a table of every arm (final held-out reward, its paired gain over the
starting export clustered by prompt, the guards, and the training seconds at which it first reaches
the baseline arm's final reward) and a PNG of the curves (mean and standard error over seeds)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch

from posttrain.eval.evaluate import paired_stats
from posttrain.tools.sweep_config import SweepConfig, read_rows, run_dir_of
from posttrain.eval.probe import prompt_mean


def mean_se(values: list[float]) -> tuple[float, float]:
    """(mean, standard error = sd / sqrt(n)) of the finite ``values``; SE is NaN for n < 2."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")


def time_to(rows: list[dict], target: float) -> float | None:
    """Training seconds at which the held-out reward (prompt mean) first reaches ``target``, linearly
    interpolated between the probes around the crossing; None if it never does."""
    prev = None
    for row in rows:
        r, t = prompt_mean(row["reward"]), row["train_s"]
        if r >= target:
            if prev is None or prev[1] >= target:
                return t
            t0, r0 = prev
            return t0 + (target - r0) / (r - r0) * (t - t0)
        prev = (t, r)
    return None


def on_grid(rows: list[dict], key: str, grid: np.ndarray) -> np.ndarray:
    """A run's ``key`` (per-prompt lists are averaged) interpolated onto ``grid`` seconds; NaN past its
    last probe."""
    t = np.array([r["train_s"] for r in rows])
    y = np.array([prompt_mean(r[key]) if isinstance(r[key], list) else r[key] for r in rows], dtype=float)
    out = np.interp(grid, t, y)
    out[grid > t[-1] + 1e-9] = np.nan
    return out


def short(entry: str) -> str:
    """A reward entry without its model path (``learned_clip@runs/x/model`` -> ``learned_clip``)."""
    return entry.partition("@")[0]


def collect(cfg: SweepConfig, task: str) -> dict[str, list[list[dict]]]:
    """{arm: [rows of each seed that has probes]} for one task."""
    out = {}
    for arm in cfg.arms:
        runs = [read_rows(run_dir_of(cfg, task, arm, s) / "probes.jsonl") for s in cfg.seeds]
        runs = [r for r in runs if r]
        if runs:
            out[arm] = runs
    return out


def arm_table(cfg: SweepConfig, task: str, data: dict) -> tuple[list[str], float]:
    """Markdown rows of one task and the target (the baseline's final reward, mean over seeds)."""
    t = cfg.tasks[task]
    base = data.get(cfg.baseline)
    target = float(np.mean([prompt_mean(runs[-1]["reward"]) for runs in base])) if base else float("nan")
    base_time = mean_se([time_to(r, target) for r in base])[0] if base else float("nan")
    head = (f"| arm | seeds | steps | s / step per seed | samples | {short(t.reward)} final (SE over seeds) | gain vs start (SE by prompt) "
            f"| z | z per seed | guard: flow-matching loss change | guard: {short(t.guard_reward)} change (SE) | seconds to reach "
            f"{cfg.baseline}'s final (SE) | reached | speed-up vs {cfg.baseline} |")
    if t.trained_reward:
        head += f" trained reward {short(t.trained_reward)}: gain (SE) | {short(t.reward)} gain minus it |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, runs in data.items():
        final = mean_se([prompt_mean(r[-1]["reward"]) for r in runs])
        start = torch.tensor([r[0]["reward"] for r in runs]).T  # [P, seeds]
        end = torch.tensor([r[-1]["reward"] for r in runs]).T
        gain, gain_se, _ = paired_stats(start, end)
        per_seed = " / ".join(f"{d / se:+.1f}" if se else "-" for d, se, _ in
                              (paired_stats(start[:, i:i + 1], end[:, i:i + 1]) for i in range(len(runs))))
        gstart = torch.tensor([r[0]["guard_reward"] for r in runs]).T
        gend = torch.tensor([r[-1]["guard_reward"] for r in runs]).T
        gdiff, gdiff_se, _ = paired_stats(gstart, gend)
        loss_change = float(np.mean([r[-1]["guard_loss"] - r[0]["guard_loss"] for r in runs]))
        times = [time_to(r, target) for r in runs]
        reached = [x for x in times if x is not None]
        tm, tse = mean_se(reached)
        speed = base_time / tm if reached and tm > 0 and math.isfinite(base_time) else float("nan")
        steps = np.mean([r[-1]["iteration"] for r in runs])
        # training seconds per iteration: a run that shared the machine shows as a slower one
        pace = " / ".join(f"{r[-1]['train_s'] / r[-1]['iteration']:.1f}" if r[-1]["iteration"] else "-" for r in runs)
        samples = np.mean([r[-1]["samples"] for r in runs])
        lines.append(
            f"| {arm} | {len(runs)} | {steps:.0f} | {pace} | {samples:.0f} | {final[0]:+.4f} ({final[1]:.4f}) | {gain:+.4f} "
            f"({gain_se:.4f}) | {gain / gain_se if gain_se else float('nan'):+.1f} | {per_seed} | {loss_change:+.4f} "
            f"| {gdiff:+.4f} ({gdiff_se:.4f}) | {'-' if not reached else f'{tm:.0f} ({tse:.0f})'} "
            f"| {len(reached)}/{len(runs)} | {'-' if speed != speed else f'{speed:.2f}x'} |"
            + (hacking_gap(runs, gain) if t.trained_reward else ""))
    return lines, target


def hacking_gap(runs: list[list[dict]], gain: float) -> str:
    """Two table cells: the trained reward's paired gain (SE) over the start, and the headline reward's
    gain minus it (negative: the trained reward rose more than the truth), "-" for runs without it."""
    if not all("trained_reward" in r[0] and "trained_reward" in r[-1] for r in runs):
        return " - | - |"
    start = torch.tensor([r[0]["trained_reward"] for r in runs]).T
    end = torch.tensor([r[-1]["trained_reward"] for r in runs]).T
    d, se, _ = paired_stats(start, end)
    return f" {d:+.4f} ({se:.4f}) | {gain - d:+.4f} |"


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Mean over seeds (axis 0) of the finite values; NaN where no seed has one (past every run's end)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, 0)


def curve_grid(cfg: SweepConfig, data: dict) -> np.ndarray:
    """The training seconds the curves are drawn at: 4 points per probe interval up to the longest run
    (a run's last iteration may end past the budget), plus every run's final probe, so a curve ends at
    the final value the table reports."""
    finals = [r[-1]["train_s"] for runs in data.values() for r in runs]
    end = max([cfg.budget_s, *(cfg.budget_of(a) for a in data), *finals])
    return np.union1d(np.linspace(0.0, end, int(math.ceil(end / cfg.eval_every_s)) * 4 + 1), finals)


def plot_task(cfg: SweepConfig, task: str, data: dict, target: float, path: Path) -> Path:
    """Four panels (held-out reward against training seconds and against samples, the flow-matching-loss
    guard and the guard reward against seconds), mean and standard-error band over seeds per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = cfg.tasks[task]
    grid = curve_grid(cfg, data)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels = ((axes[0, 0], "reward", f"held-out {short(t.reward)}"),
              (axes[1, 0], "guard_loss", "guard: held-out flow-matching loss"),
              (axes[1, 1], "guard_reward", f"guard: held-out {short(t.guard_reward)}"))
    for arm, runs in data.items():
        for ax, key, _ in panels:
            ys = np.stack([on_grid(r, key, grid) for r in runs])
            m = _nanmean(ys)
            with warnings.catch_warnings():  # a grid point only one seed reaches has no spread
                warnings.simplefilter("ignore", RuntimeWarning)
                se = np.nanstd(ys, 0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else np.zeros_like(m)
            lw = 2.5 if arm == cfg.baseline else 1.5
            ax.plot(grid, m, label=arm, lw=lw)
            ax.fill_between(grid, m - se, m + se, alpha=0.15)
        samples = _nanmean(np.stack([on_grid(r, "samples", grid) for r in runs]))
        reward = _nanmean(np.stack([on_grid(r, "reward", grid) for r in runs]))
        axes[0, 1].plot(samples, reward, label=arm, lw=2.5 if arm == cfg.baseline else 1.5)
    for ax in (axes[0, 0], axes[0, 1]):
        if math.isfinite(target):
            ax.axhline(target, ls="--", c="gray", lw=1, label=f"{cfg.baseline} final")
    for ax, _, title in panels:
        ax.set_xlabel("training seconds (rollout + reward + update)")
        ax.set_title(title)
    axes[0, 1].set_xlabel("samples drawn")
    axes[0, 1].set_title(f"held-out {short(t.reward)} against samples")
    axes[0, 0].legend(fontsize=8)
    seeds = max(len(runs) for runs in data.values())
    fig.suptitle(f"sweep task '{task}': {seeds} seed(s), budget {cfg.budget_s:.0f} s per run, "
                 f"{cfg.probe.num_prompts} held-out prompts x {cfg.probe.samples_per_prompt}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def own_budgets(cfg: SweepConfig, arms: list[str]) -> str:
    """", arm a: 240 s" for the ``arms`` with a budget of their own ("" when none has)."""
    return "".join(f", {a}: {cfg.budget_of(a):.0f} s" for a in arms if cfg.arms[a].budget_s)


def write_report(cfg: SweepConfig) -> Path:
    """``<run_dir>/report.md`` and one ``<task>.png`` per task with probes; returns the report path."""
    root = Path(cfg.run_dir)
    ran = {task: collect(cfg, task) for task in cfg.tasks}
    arms = [a for a in cfg.arms if any(a in data for data in ran.values())]
    trained = [r[-1]["train_s"] for data in ran.values() for runs in data.values() for r in runs]
    spent = (f"; the runs trained {min(trained):.0f}-{max(trained):.0f} s (a run stops at the first iteration "
             f"boundary past the budget)" if trained else "")
    lines = [f"# Sweep: {', '.join(arms) or '(no arm has run)'}", "",
             f"Each run trains until it has spent its budget of {cfg.budget_s:.0f} s{own_budgets(cfg, arms)} "
             f"(rollout, reward and update; "
             f"probes, checkpoints and set-up not counted){spent}, from `{cfg.pretrained}`, seeds "
             f"{list(cfg.seeds)}. Held-out probes every "
             f"{cfg.eval_every_s:.0f} s: {cfg.probe.num_prompts} held-out prompts x {cfg.probe.samples_per_prompt} "
             f"seed(s), ODE {cfg.probe.num_inference_steps} steps, guidance {cfg.probe.guidance_scale}, the same "
             f"for every arm. Gains are paired with the run's own probe at 0 s (the starting export), per-prompt "
             f"means over seeds, SE clustered by prompt; the time to reach the baseline's final reward is "
             f"interpolated between probes, its SE over the seeds that reached it.", ""]
    for task in cfg.tasks:
        data = ran[task]
        if not data:
            lines += [f"## {task}", "", "(not run)", ""]
            continue
        rows, target = arm_table(cfg, task, data)
        png = plot_task(cfg, task, data, target, root / f"{task}.png")
        t = cfg.tasks[task]
        base = data.get(cfg.baseline) or []
        start = float(np.mean([prompt_mean(runs[0]["reward"]) for runs in base])) if base else float("nan")
        moot = (f" {cfg.baseline} ended at or below its start ({start:+.4f}), so every run starts at the target: "
                f"the seconds-to-reach column says nothing here; compare the gains." if start >= target else "")
        lines += [f"## {task}", "", f"Held-out reward `{t.reward}`, guard reward `{t.guard_reward}`. Target: "
                  f"{cfg.baseline}'s final held-out {short(t.reward)}, {target:+.4f}.{moot}", "", *rows, "",
                  f"![{task}]({png.name})", ""]
    path = root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
