"""Throughput of one GRPO iteration at flow_grpo's tiny SD3 settings (configs/bench/flowgrpo_tiny_sd3.yaml).

    python benchmarks/grpo_iteration.py [--iterations 5] [--warmup 1] [--sweeps 1] [--variants all]
        [--device-layouts] [--tradeoffs] [--breakdown] [key=value ...]

Per variant (speed options toggled one at a time, each keeping the algorithm's semantics): samples/s,
seconds per phase (rollout, decode, reward wait, training), useful FLOPs per iteration counted with
``torch.utils.flop_counter`` (CPU attention included, see :mod:`benchmarks.kernel_rates`) and that over
the machine's fp32 matmul rate measured in this run at the model's GEMM shapes (a CPU "MFU"), the
iteration's floor at the kernel rates measured in this run, peak RSS. Each row runs in a fresh process,
which measures the kernel rates itself after its warm-up (the machine drifts within a run: a row's floor
uses the medians of the rates its own processes measured).
The first row is flow_grpo's layout, the baseline every other row is compared with in the same run.
flow_grpo's own scripts/train_sd3.py (commit ac4c86e8, its pinned diffusers / transformers / accelerate /
peft, torch 2.14.1), run on this
project's machine kind at exactly these settings, alternating with this benchmark in one quiet session,
did 1.19 and 1.12 samples/s against 1.17 and 1.34 for the first row: the first row stands for flow_grpo
(the machine drifts 10-15 % between runs, so only ratios within one run are compared). Algorithm
changes that trade quality for speed are listed apart and are not part of that comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_assets import build_assets  # noqa: E402
from benchmarks.kernel_rates import (CPU_ATTENTION_FORMULAS, FLOOR_CLASSES, attention_gflops,  # noqa: E402
                                     floor_by_class, is_attention, matmul_gflops, model_shape_gflops)
from benchmarks.time_breakdown import CLASSES, enable_kernel_names, profiled_breakdown  # noqa: E402
from posttrain.grpo.stage import GRPOConfig, GRPORun  # noqa: E402
from pretrain.runtime.loop import step_once  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.runtime.profiling import peak_rss_mb  # noqa: E402

CONFIG = "configs/bench/flowgrpo_tiny_sd3.yaml"
FLOW_GRPO_SIDE_BY_SIDE = ((1.190, 1.174), (1.119, 1.340))  # (flow_grpo, first row) samples/s, two pairs
# name -> overrides; each row adds one speed option to the one above (same loss and gradients).
_NO_REUSE, _FREE = "perf.reuse_rollout_uncond=false", "train.keep_freed_memory=false"
_TANH = "perf.sigmoid_gelu=false"  # on by default with perf.compile
VARIANTS = {
    "flow_grpo layout": ["perf.uncond_in_batch=true", "perf.merge_lora=false", "perf.reward_workers=0", _NO_REUSE,
                         _FREE],
    "+ uncond branch without graph": ["perf.merge_lora=false", "perf.reward_workers=0", _NO_REUSE, _FREE],
    "+ LoRA merged for no-grad forwards": ["perf.reward_workers=0", _NO_REUSE, _FREE],
    "+ rollout's uncond velocities before the first step": ["perf.reward_workers=0", _FREE],
    "+ torch.compile per block": ["perf.reward_workers=0", "perf.compile=true", _FREE, _TANH],
    "+ freed memory kept for reuse (malloc)": ["perf.reward_workers=0", "perf.compile=true", _TANH],
    "+ tanh-GELU as x*sigmoid(2z), bias in its kernel": ["perf.reward_workers=0", "perf.compile=true"],
    "+ VAE decoder compiled": ["perf.reward_workers=0", "perf.compile=true", "perf.compile_decoder=true"],
    "+ reward scored during rollout (a thread)": ["perf.compile=true", "perf.compile_decoder=true"],
}
# Algorithm changes (not counted toward the comparison).
TRADEOFFS = {"train 5 of 10 transitions": ["rollout.timestep_fraction=0.5"]}
# Same semantics, a layout that pays on GPUs (launch-bound there) and costs activation traffic on CPUs.
DEVICE_LAYOUTS = {"all trained transitions in one forward (GPU layout)":
                  ["perf.reward_workers=0", "perf.compile=true", "perf.transitions_per_forward=0"]}


def count_flops(run: GRPORun) -> dict[str, int]:
    """FLOPs of one iteration (forward, backward, decode) per op (``aten.X`` -> ``X``), counted on a separate,
    untimed iteration, CPU attention included (:data:`benchmarks.kernel_rates.CPU_ATTENTION_FORMULAS`)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS) as counter:
        step_once(run)
    return {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


def measure_rates(device: torch.device) -> dict[str, float]:
    """This machine's rates now, GFLOP/s: 2048^3 matmul, the model's GEMM shapes, attention forward / backward."""
    attention = attention_gflops(device)
    return {"matmul": matmul_gflops(2048, 2048, 2048, device, 1.0), "gemm": model_shape_gflops(device),
            "attention_forward": attention[0], "attention_backward": attention[1]}


def floors_at(rates: dict[str, float], flops: dict[str, int]) -> dict[str, float]:
    """:func:`benchmarks.kernel_rates.floor_by_class` at ``rates`` (:func:`measure_rates`'s keys)."""
    return floor_by_class(flops, rates["gemm"], (rates["attention_forward"], rates["attention_backward"]),
                          rates["matmul"])


def bench(name: str, overrides: list[str], common: list[str], iterations: int, warmup: int,
          flops: bool = True, breakdown: bool = False) -> dict:
    """Warm-up + ``iterations`` timed iterations (+ one FLOP-counted one when ``flops``, + one profiled
    one when ``breakdown``, with inductor's kernel names on), in a fresh run directory; returns the timed
    iterations' metrics (``rows``), the kernel rates measured after the warm-up (when it times any), the counted FLOPs and the
    profiled iteration's seconds per class."""
    if breakdown:
        enable_kernel_names()
    run_dir = tempfile.mkdtemp(prefix="grpo_bench_")
    cfg = load_config(GRPOConfig, CONFIG, [*common, *overrides, f"run_dir={run_dir}",
                                           f"train.steps={warmup + iterations + 2}", "checkpoint.every=0"])
    run = GRPORun(cfg)
    for _ in range(warmup):
        step_once(run)
    rates = measure_rates(run.st.device) if iterations else None  # --breakdown's run: the timed ones' rates
    rows = []
    for i in range(iterations):
        rows.append(step_once(run))
        print(f"    {name} iteration {i + 1}: {rows[-1]['samples_per_s']:.3f} samples/s", flush=True)
    counted = count_flops(run) if flops else None
    classes = profiled_breakdown(lambda: step_once(run)) if breakdown else None
    run.scorer.close()
    run.logger.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"name": name, "flops": counted, "samples": run.n, "rows": rows, "peak_rss_mb": peak_rss_mb(),
            "rates": rates, "breakdown": classes}


def bench_isolated(*args) -> dict:
    """:func:`bench` in a fresh Python process, so that process-wide state (the allocator's settings, compiled
    code, peak RSS) is the row's own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        subprocess.run([sys.executable, __file__, "--row", json.dumps(args), "--row-out", str(out)], check=True)
        return json.loads(out.read_text())


def medians(results: list[dict]) -> dict:
    """One variant's sweeps folded: the median of every float metric over all their timed iterations."""
    rows = [row for r in results for row in r["rows"]]
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    rates = {k: statistics.median(r["rates"][k] for r in results) for k in results[0]["rates"]}
    return {**results[0], **med, "rates": rates, "peak_rss_mb": max(r["peak_rss_mb"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default="all", help="comma-separated row numbers (0-based) or 'all'")
    ap.add_argument("--tradeoffs", action="store_true", help="also time the algorithm-changing configs")
    ap.add_argument("--device-layouts", action="store_true",
                    help="also time the same-semantics layouts that pay on GPUs (all transitions in one forward)")
    ap.add_argument("--sweeps", type=int, default=1,
                    help="passes over the variants, every other one in reverse order (drift in the machine's "
                         "speed then falls on every variant alike); medians over all passes")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile one iteration per variant (its own process, after the sweeps) and print its "
                         "time by kernel class against each class's floor")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one bench() call's arguments as JSON
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every variant")
    a = ap.parse_args()
    if a.row:
        Path(a.row_out).write_text(json.dumps(bench(*json.loads(a.row))))
        return
    # the config's data folder is built here, so read it before the config's data block is validated
    pre = load_config(GRPOConfig, CONFIG, [*a.overrides, "data.source=openmoji"])
    build_assets(pre.model, pre.model.pretrained, pre.data.path)
    base = load_config(GRPOConfig, CONFIG, a.overrides)
    torch.set_num_threads(base.train.threads or torch.get_num_threads())
    device = torch.device("cuda" if base.train.device.startswith("cuda") else "cpu")
    start = measure_rates(device)
    print(f"device {device}, {torch.get_num_threads()} threads; fp32 GFLOP/s at the start (each row's process "
          f"measures its own): " + rates_text(start), flush=True)
    chosen = list(VARIANTS.items())
    if a.variants != "all":
        chosen = [chosen[int(i)] for i in a.variants.split(",")]
    if a.device_layouts:
        chosen += list(DEVICE_LAYOUTS.items())
    if a.tradeoffs:
        chosen += list(TRADEOFFS.items())
    runs: dict[str, list[dict]] = {name: [] for name, _ in chosen}
    for sweep in range(a.sweeps):
        for name, ov in chosen if sweep % 2 == 0 else chosen[::-1]:
            runs[name].append(bench_isolated(name, ov, a.overrides, a.iterations, a.warmup, not runs[name]))
            rate = statistics.median(row["samples_per_s"] for row in runs[name][-1]["rows"])
            print(f"  {name} (pass {sweep + 1}): {rate:.3f} samples/s", flush=True)
    results = [medians(runs[name]) for name, _ in chosen]
    for r in results:
        r["floors"] = floors_at(r["rates"], r["flops"])
        r["total"], r["floor_s"] = sum(r["flops"].values()), sum(r["floors"].values())
        r["attention"] = sum(n for op, n in r["flops"].items() if is_attention(op))
    lean = min((r for r in results if r["name"] not in TRADEOFFS), key=lambda r: r["total"])
    first = results[0]["samples_per_s"]
    print("\n| variant | samples/s | vs first row (flow_grpo layout) | rollout s | decode s | reward wait s "
          "| train s | GFLOP/iter counted (attention) | CPU-MFU | floor s (share reached) | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        it_s = r["samples"] / r["samples_per_s"]
        mfu = lean["total"] / it_s / (r["rates"]["gemm"] * 1e9)
        print(f"| {r['name']} | {r['samples_per_s']:.3f} | {r['samples_per_s'] / first:.2f}x | "
              f"{r['time_rollout_s']:.2f} | {r['time_decode_s']:.2f} | "
              f"{r['time_reward_wait_s']:.3f} | {r['time_train_s']:.2f} | {r['total'] / 1e9:.0f} "
              f"({r['attention'] / 1e9:.0f}) | {mfu:.2f} | {r['floor_s']:.2f} ({r['floor_s'] / it_s:.2f}) | "
              f"{r['peak_rss_mb']:.0f} |")
    print("\nkernel rates per row (medians of its processes, GFLOP/s): "
          + "; ".join(f"{r['name']}: {rates_text(r['rates'])}" for r in results))
    print(f"\nuseful work: {lean['total'] / 1e12:.3f} TFLOP/iteration, {(lean['total'] - lean['attention']) / 1e12:.3f}"
          f" without attention (the leanest same-semantics variant's count; CPU-MFU is it over the model-shape GEMM "
          f"rate). flow_grpo side by side on this machine kind (another session, alternating runs): "
          + ", ".join(f"{f:.3f} samples/s against the first row's {p:.3f}" for f, p in FLOW_GRPO_SIDE_BY_SIDE)
          + " (its 0.97 TFLOP figure, like the CPU counter without these formulas, leaves attention out). "
          f"The leanest variant's counted work at this machine's kernel rates needs {lean['floor_s']:.2f} s: at most "
          f"{lean['samples'] / lean['floor_s']:.3f} samples/s before any elementwise op or overhead. Peak RSS is "
          f"each row's process's.")
    if a.breakdown:
        for r, (name, ov) in zip(results, chosen):
            r["breakdown"] = bench_isolated(name, ov, a.overrides, 0, a.warmup, False, True)["breakdown"]
        print_breakdown(results)


def rates_text(rates: dict[str, float]) -> str:
    """``rates`` (:func:`measure_rates`) as one line."""
    return (f"2048^3 matmul {rates['matmul']:.1f}, model GEMM shapes {rates['gemm']:.1f}, attention forward "
            f"{rates['attention_forward']:.1f} / backward {rates['attention_backward']:.1f}")


def print_breakdown(results: list[dict]) -> None:
    """One profiled iteration per variant: seconds per kernel class, the counted classes with their floor
    in parentheses, and the share of the floor reached with and without the elementwise work."""
    print("\n| variant | profiled iteration s | " + " | ".join(
        f"{c} s{' (floor)' if c in FLOOR_CLASSES else ''}" for c in CLASSES)
        + " | share of floor | share without elementwise |")
    print("|---" * (len(CLASSES) + 4) + "|")
    for r in results:
        b, floors = r["breakdown"], r["floors"]
        elementwise = b["fused elementwise (compiled)"] + b["eager ATen ops"]
        cells = [f"{b[c]:.2f}" + (f" ({floors[c]:.2f})" if c in FLOOR_CLASSES else "") for c in CLASSES]
        print(f"| {r['name']} | {b['wall']:.2f} | " + " | ".join(cells)
              + f" | {r['floor_s'] / b['wall']:.2f} | {r['floor_s'] / (b['wall'] - elementwise):.2f} |")
    print("\nProfiled with torch.profiler (its overhead is in every op, most in the many small ones); "
          "'outside any op' is the iteration's wall time that no recorded op accounts for (Python).")


if __name__ == "__main__":
    main()
