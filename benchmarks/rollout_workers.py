"""Iteration time of the colocated rollout against Ray rollout workers in ``sync`` and ``one_step_off``
mode, with a reward that waits like a served one (JPEG compressibility plus ``--latency`` seconds per
rollout batch, as ``benchmarks/async_reward.py``) and the rollout and training on separate cores (the
trainer and each worker on one thread).

    python benchmarks/rollout_workers.py [--export DIR] [--iterations 4] [--latency 0.5] [--out FILE.json]

Every mode trains with ``grpo.old_log_prob: recompute`` (one_step_off needs it for its correction), so
the training work is the same in all three. The modes run one after the other (a mode's workers
sample ahead, so interleaving iterations would let them sample during another mode's step); the first
iteration of each is a warm-up, the figures are medians of the others. The line to read:
``one_step_off`` iteration time against max(rollout, training) of the ``sync`` run, the overlap's
ideal (at most 1.15x). Without ``--export`` a tiny model is pretrained first (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from posttrain.grpo.stage import GRPOConfig, GRPORun  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.runtime.loop import step_once  # noqa: E402
from rewards.jpeg import jpeg_size_kb  # noqa: E402

MODES = {"colocated": ["engine.name=local"],
         "sync": ["engine.name=ray", "engine.mode=sync"],
         "one_step_off": ["engine.name=ray", "engine.mode=one_step_off"]}


def slow_jpeg(images, prompts=None, metadata=None, latency: float = 0.5):
    """-(JPEG kB) after waiting ``latency`` seconds: a reward served elsewhere (occupies no local core)."""
    time.sleep(latency)
    return -jpeg_size_kb(images)


def tiny_export(root: Path) -> Path:
    from pretrain.trainer import PretrainConfig, train

    cfg = load_config(PretrainConfig, ROOT / "configs/pretrain/emoji_tiny.yaml",
                      [f"run_dir={root}", "train.steps=20", "eval.every=0"])
    return train(cfg)


def run_mode(mode: str, a, export: Path) -> dict:
    cfg = load_config(GRPOConfig, ROOT / a.config, [
        f"model.pretrained={export}", f"run_dir={tempfile.mkdtemp()}", "checkpoint.every=0", "eval.every=0",
        f"train.steps={a.iterations + 1}", "train.threads=1", "engine.workers=1", "engine.num_cpus=1",
        f"rollout.prompts_per_step={a.prompts}", f"rollout.batch_size={a.rollout_batch}",
        f"rollout.num_inference_steps={a.steps}", "grpo.old_log_prob=recompute", *MODES[mode]])
    cfg.rewards = {"benchmarks.rollout_workers:slow_jpeg": {"weight": 1.0, "latency": a.latency}}
    run = GRPORun(cfg)
    rows, times = [], []
    try:
        for _ in range(a.iterations + 1):
            t0 = time.perf_counter()
            rows.append(step_once(run))
            times.append(time.perf_counter() - t0)
    finally:
        run.engine.close()
        run.scorer.close()
    rows, times = rows[1:], times[1:]  # the first iteration warms up (and starts the workers)

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    out = {"iteration_s": statistics.median(times),
           "rollout_s": med("time_rollout_s") + med("time_decode_s") + med("time_reward_wait_s"),
           "training_s": med("time_old_log_prob_s") + med("time_train_s"),
           "old_log_prob_s": med("time_old_log_prob_s"), "staleness_max": max(r["staleness_max"] for r in rows)
           if "staleness_max" in rows[0] else 0, "samples": run.n}
    print(f"{mode:>13}: {out['iteration_s']:.2f} s/iteration; waiting for samples + rewards {out['rollout_s']:.2f} s, "
          f"training {out['training_s']:.2f} s (of which old log-probs {out['old_log_prob_s']:.2f} s), "
          f"staleness {out['staleness_max']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/grpo/emoji_tiny.yaml")
    ap.add_argument("--export", help="an export folder (default: pretrain the tiny preset first)")
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per mode, after one warm-up")
    ap.add_argument("--latency", type=float, default=0.5, help="reward seconds per rollout batch")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rollout-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="rollout.num_inference_steps")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    export = Path(a.export) if a.export else tiny_export(Path(tempfile.mkdtemp()))
    res = {mode: run_mode(mode, a, export) for mode in MODES}
    sync, off = res["sync"], res["one_step_off"]
    ideal = max(sync["rollout_s"], sync["training_s"])
    res["one_step_off_vs_ideal"] = off["iteration_s"] / ideal
    res["one_step_off_speedup_vs_sync"] = sync["iteration_s"] / off["iteration_s"]
    res["sync_vs_colocated"] = sync["iteration_s"] / res["colocated"]["iteration_s"]
    print(f"one_step_off: {off['iteration_s']:.2f} s = {res['one_step_off_vs_ideal']:.2f} x max(rollout "
          f"{sync['rollout_s']:.2f} s, training {sync['training_s']:.2f} s) of the sync run (target <= 1.15); "
          f"{res['one_step_off_speedup_vs_sync']:.2f}x faster than sync; sync = {res['sync_vs_colocated']:.2f} x "
          f"colocated")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
