"""What SDE windows buy: one GRPO iteration of Flow-GRPO (every transition stochastic, 9 of 10 trained),
Flow-GRPO-Fast (a window of 2) and MixGRPO (a window of 4 of 10) at the quickstart's settings
(configs/grpo/emoji_jpeg.yaml: the 5 M-parameter emoji model, 64 samples, 10 steps), in one run.

    python benchmarks/grpo_windows.py [--iterations 3] [--warmup 1] [--sweeps 2] [--export PATH] [key=value ...]

Timing does not depend on the weights: without ``--export`` a 1-step pretraining export of the quickstart's
preset is written to a temporary folder. Per variant: the median seconds of each phase (rollout, decode,
reward wait, training) over all timed iterations, and the training phase and the whole iteration as
ratios to Flow-GRPO's measured in the same run. Variants alternate order between sweeps, so drift in the
machine's speed falls on all of them alike. The windows train 2 and 4 of Flow-GRPO's 9 transitions, so
the training phase's ideal ratios are 0.22 and 0.44; the rollout is the same 10 model calls in all three.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain.grpo.stage import GRPOConfig, GRPORun  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.runtime.loop import step_once  # noqa: E402

CONFIG = "configs/grpo/emoji_jpeg.yaml"
PRETRAIN = "configs/pretrain/emoji_small.yaml"
VARIANTS = {
    "Flow-GRPO (9 of 10 trained)": [],
    "Flow-GRPO-Fast (window 2)": ["rollout.sde_window={mode: random, size: 2, min_size: 2, start: 0, end: 5}"],
    "MixGRPO (window 4 of 10)": ["rollout.sde_window={mode: progressive, size: 4, start: 0, every: 1}"],
}
PHASES = ("time_rollout_s", "time_decode_s", "time_reward_wait_s", "time_train_s")


def pretrain_export(root: Path) -> Path:
    """A 1-step pretraining export of the quickstart's preset under ``root``."""
    from pretrain.trainer import PretrainConfig, train

    return train(load_config(PretrainConfig, PRETRAIN, [f"run_dir={root}", "train.steps=1", "eval.every=0",
                                                        "checkpoint.every=0"]))


def bench(overrides: list[str], export: Path, iterations: int, warmup: int) -> list[dict]:
    """``warmup`` untimed + ``iterations`` timed iterations of a fresh run; their metrics."""
    run_dir = tempfile.mkdtemp(prefix="grpo_windows_")
    cfg = load_config(GRPOConfig, CONFIG, [*overrides, f"run_dir={run_dir}", f"model.pretrained={export}",
                                           f"train.steps={warmup + iterations}", "checkpoint.every=0", "eval.every=0"])
    run = GRPORun(cfg)
    for _ in range(warmup):
        step_once(run)
    rows = [step_once(run) for _ in range(iterations)]
    run.scorer.close()
    run.logger.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--export", help="an export to post-train (default: a 1-step pretraining export)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every variant")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="grpo_windows_export_"))
    export = Path(a.export) if a.export else pretrain_export(tmp)
    torch.set_num_threads(load_config(GRPOConfig, CONFIG, [f"model.pretrained={export}"]).train.threads or 2)
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for sweep in range(a.sweeps):
        order = list(VARIANTS.items()) if sweep % 2 == 0 else list(VARIANTS.items())[::-1]
        for name, ov in order:
            rows[name] += bench([*ov, *a.overrides], export, a.iterations, a.warmup)
            print(f"  {name} (pass {sweep + 1}): train {statistics.median(r['time_train_s'] for r in rows[name]):.2f} s",
                  flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in PHASES} for name, rs in rows.items()}
    for m in med.values():
        m["iteration_s"] = sum(m[k] for k in PHASES)
    base = med[next(iter(VARIANTS))]
    print(f"\n{torch.get_num_threads()} threads; medians of {a.iterations * a.sweeps} iterations per variant\n")
    print("| variant | rollout s | decode s | reward wait s | train s | train vs Flow-GRPO | iteration s "
          "| iteration vs Flow-GRPO |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['time_rollout_s']:.2f} | {m['time_decode_s']:.3f} | {m['time_reward_wait_s']:.3f} | "
              f"{m['time_train_s']:.2f} | {m['time_train_s'] / base['time_train_s']:.2f}x | {m['iteration_s']:.2f} | "
              f"{m['iteration_s'] / base['iteration_s']:.2f}x |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
