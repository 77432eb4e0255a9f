"""Throughput of one GRPO iteration at flow_grpo's tiny SD3 settings (configs/bench/flowgrpo_tiny_sd3.yaml).

    python benchmarks/grpo_iteration.py [--iterations 5] [--warmup 1] [--variants all] [key=value ...]

Per variant (speed options toggled one at a time, each keeping the algorithm's semantics): samples/s,
seconds per phase (rollout, decode, reward wait, training), useful FLOPs per iteration counted with
``torch.utils.flop_counter`` and that over the machine's fp32 matmul rate measured in this run at the
model's GEMM shapes (a CPU "MFU"), peak RSS. flow_grpo's own scripts/train_sd3.py did 0.53 samples/s at
these settings on a machine whose fp32 2048^3 matmul ran at 54 GFLOP/s (2 threads); the last table
scales that to this machine's measured 2048^3 rate. Algorithm changes that trade quality for speed are
listed apart and are not part of that comparison.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_assets import build_assets  # noqa: E402
from posttrain.grpo import GRPOConfig, GRPORun  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.runtime.profiling import peak_rss_mb  # noqa: E402

CONFIG = "configs/bench/flowgrpo_tiny_sd3.yaml"
FLOW_GRPO_SAMPLES_PER_S, FLOW_GRPO_MATMUL_GFLOPS = 0.53, 54.0
# name -> overrides; each row adds one speed option to the one above (same loss and gradients).
VARIANTS = {
    "flow_grpo layout": ["perf.uncond_in_batch=true", "perf.merge_lora=false", "perf.reward_workers=0"],
    "+ uncond branch without graph": ["perf.merge_lora=false", "perf.reward_workers=0"],
    "+ LoRA merged for no-grad forwards": ["perf.reward_workers=0"],
    "+ reward scored during rollout": [],
    "+ all trained transitions in one forward": ["perf.transitions_per_forward=0"],
    "+ torch.compile per block": ["perf.transitions_per_forward=0", "perf.compile=true"],
}
# Algorithm changes (not counted toward the comparison).
TRADEOFFS = {"train 5 of 10 transitions": ["rollout.timestep_fraction=0.5"]}


def matmul_gflops(m: int, k: int, n: int, device: torch.device, seconds: float = 1.0) -> float:
    """fp32 ``[m, k] @ [k, n]`` rate in GFLOP/s (median of timed repeats for about ``seconds``)."""
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def model_shape_gflops(device: torch.device, tokens: int = 8 * 256) -> float:
    """Aggregate fp32 rate over the transformer's GEMMs: a rollout batch of 8 x 256 image tokens against
    hidden 128 (attention projections, LoRA r 32) and the 4x MLP."""
    shapes = [(tokens, 128, 128), (tokens, 128, 512), (tokens, 512, 128), (tokens, 128, 32), (tokens, 32, 128)]
    flops = [2 * m * k * n for m, k, n in shapes]
    secs = [f / (matmul_gflops(*s, device, 0.3) * 1e9) for f, s in zip(flops, shapes)]
    return sum(flops) / sum(secs) / 1e9


def count_flops(run: GRPORun) -> float:
    """FLOPs of one iteration (forward, backward, decode), counted on a separate, untimed iteration."""
    with FlopCounterMode(display=False) as counter:
        run.iteration()
    return float(counter.get_total_flops())


def bench(name: str, overrides: list[str], common: list[str], iterations: int, warmup: int) -> dict:
    """Warm-up + ``iterations`` timed iterations + one FLOP-counted one, in a fresh run directory."""
    run_dir = tempfile.mkdtemp(prefix="grpo_bench_")
    cfg = load_config(GRPOConfig, CONFIG, [*common, *overrides, f"run_dir={run_dir}",
                                           f"train.steps={warmup + iterations + 1}", "checkpoint.every=0"])
    run = GRPORun(cfg)
    for _ in range(warmup):
        run.iteration()
    rows = []
    for i in range(iterations):
        rows.append(run.iteration())
        print(f"    {name} iteration {i + 1}: {rows[-1]['samples_per_s']:.3f} samples/s", flush=True)
    flops = count_flops(run)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    run.scorer.close()
    run.logger.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"name": name, "flops": flops, "samples": run.n, **med, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default="all", help="comma-separated row numbers (0-based) or 'all'")
    ap.add_argument("--tradeoffs", action="store_true", help="also time the algorithm-changing configs")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every variant")
    a = ap.parse_args()
    base = load_config(GRPOConfig, CONFIG, a.overrides)
    torch.set_num_threads(base.train.threads or torch.get_num_threads())
    device = torch.device("cuda" if base.train.device.startswith("cuda") else "cpu")
    build_assets(base.model, base.model.pretrained, base.data.path)
    ref_rate = matmul_gflops(2048, 2048, 2048, device, 2.0)
    shape_rate = model_shape_gflops(device)
    print(f"device {device}, {torch.get_num_threads()} threads; fp32 matmul: 2048^3 {ref_rate:.1f} GFLOP/s, "
          f"model GEMM shapes {shape_rate:.1f} GFLOP/s", flush=True)
    chosen = list(VARIANTS.items())
    if a.variants != "all":
        chosen = [chosen[int(i)] for i in a.variants.split(",")]
    if a.tradeoffs:
        chosen += list(TRADEOFFS.items())
    results = []
    for name, ov in chosen:
        r = bench(name, ov, a.overrides, a.iterations, a.warmup)
        results.append(r)
        print(f"  {name}: {r['samples_per_s']:.3f} samples/s", flush=True)
    useful = min(r["flops"] for r in results if r["name"] in VARIANTS)
    first = results[0]["samples_per_s"]
    flow_grpo_here = FLOW_GRPO_SAMPLES_PER_S * ref_rate / FLOW_GRPO_MATMUL_GFLOPS
    print("\n| variant | samples/s | vs first row | vs flow_grpo (scaled) | rollout s | decode s | reward wait s "
          "| train s | GFLOP/iter counted | CPU-MFU | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        it_s = r["samples"] / r["samples_per_s"]
        mfu = useful / it_s / (shape_rate * 1e9)
        print(f"| {r['name']} | {r['samples_per_s']:.3f} | {r['samples_per_s'] / first:.2f}x | "
              f"{r['samples_per_s'] / flow_grpo_here:.2f}x | {r['time_rollout_s']:.2f} | {r['time_decode_s']:.2f} | "
              f"{r['time_reward_wait_s']:.3f} | {r['time_train_s']:.2f} | {r['flops'] / 1e9:.0f} | {mfu:.2f} | "
              f"{r['peak_rss_mb']:.0f} |")
    print(f"\nuseful work: {useful / 1e12:.3f} TFLOP/iteration (the leanest same-semantics variant's count); "
          f"flow_grpo scaled to this machine: {FLOW_GRPO_SAMPLES_PER_S} x {ref_rate:.1f} / {FLOW_GRPO_MATMUL_GFLOPS}"
          f" = {flow_grpo_here:.3f} samples/s")


if __name__ == "__main__":
    main()
