"""Iteration time with the reward scored during the rollout (``perf.reward_workers=1``) vs after it
(``0``), on a GRPO config, with a reward that waits like a served one: JPEG compressibility plus
``--latency`` seconds per rollout batch (the network and the remote model's time; it occupies no
local core, as a reward served from another machine).

    python benchmarks/async_reward.py --export runs/emoji_jpeg_hack/pretrain/export [--latency 2] [--iterations 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain.grpo.stage import GRPOConfig, GRPORun  # noqa: E402

from pretrain.runtime.loop import step_once  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from rewards.jpeg import jpeg_size_kb  # noqa: E402

def slow_jpeg(images, prompts=None, metadata=None, latency: float = 2.0):
    """-(JPEG kB) after waiting ``latency`` seconds: a stand-in for a reward served elsewhere."""
    time.sleep(latency)
    return -jpeg_size_kb(images)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/grpo/emoji_jpeg.yaml")
    ap.add_argument("--export", required=True)
    ap.add_argument("--latency", type=float, default=2.0)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--rollout-batch", type=int, default=16)
    a = ap.parse_args()
    runs = {}
    for workers in (0, 1):  # both runs built first, then iterated alternately: load changes hit both
        cfg = load_config(GRPOConfig, a.config, [f"model.pretrained={a.export}", f"run_dir={tempfile.mkdtemp()}",
                                                 f"rollout.batch_size={a.rollout_batch}", "checkpoint.every=0",
                                                 f"train.steps={a.iterations + 1}", f"perf.reward_workers={workers}",
                                                 "eval.every=0"])
        cfg.rewards = {"benchmarks.async_reward:slow_jpeg": {"weight": 1.0, "latency": a.latency}}
        runs[workers] = GRPORun(cfg)
    rows = {0: [], 1: []}
    for _ in range(a.iterations):
        for workers, run in runs.items():
            rows[workers].append(step_once(run))
    med = {}
    for workers, run in runs.items():
        run.scorer.close()
        m = med[workers] = {k: statistics.median(r[k] for r in rows[workers])
                            for k in ("samples_per_s", "time_rollout_s", "time_decode_s", "time_reward_wait_s",
                                      "time_train_s")}
        m["sample_and_score_s"] = m["time_rollout_s"] + m["time_decode_s"] + m["time_reward_wait_s"]
        print(f"reward_workers={workers}: rollout + decode + reward wait {m['sample_and_score_s']:.1f} s, "
              f"train {m['time_train_s']:.1f} s, {run.n / m['samples_per_s']:.1f} s/iteration; "
              f"{run.n // a.rollout_batch} rollout batches x {a.latency} s latency", flush=True)
    print(f"sampling + scoring: {med[0]['sample_and_score_s'] / med[1]['sample_and_score_s']:.2f}x faster with "
          f"scoring during the rollout; whole iteration {med[1]['samples_per_s'] / med[0]['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
