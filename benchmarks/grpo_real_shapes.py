"""GRPO iterations at a real model's shapes (random weights) through the FSDP2 path on one rank, LoRA and full
fine-tuning: samples/s, seconds per phase, peak memory, and the MFU of the training update and of the rollout
(FLOPs counted by ``torch.utils.flop_counter`` on an extra, untimed iteration, over the phase's median time
and the device's peak); then a bf16 pretraining step of the transformer at the same shapes
(:func:`benchmarks.low_precision_step.run`; its ``tiny`` is a smaller model than the GRPO run's).

    torchrun --standalone --nproc_per_node 1 benchmarks/grpo_real_shapes.py --out $OUT          # a GPU, bf16
    torchrun --standalone --nproc_per_node 1 benchmarks/grpo_real_shapes.py --shape tiny --device cpu \\
        --backend gloo --precision fp32 --prompts 2 --group-size 2 --steps 3 --out /tmp/o     # CPU dry run

``sd3_medium``: SD3.5-Medium's transformer shapes (24 joint blocks, 24 heads x 64 = 1536 wide, RMS q/k
norm, patch 2), conditioning (333 tokens x 4096, pooled 2048) and image size (512 px: 16 x 64 x 64
latents, decoded by SD3's 128-512 channel VAE); ``tiny``: ``configs/bench/flowgrpo_tiny_sd3.yaml``'s
(:mod:`benchmarks.bench_assets`). The prompts are the captions of a generated shapes folder. GRPO
settings are that config's (10 SDE steps, 9 trained transitions, CFG 4.5, PPO-clip + KL, 2 optimizer
steps per iteration, JPEG reward) at ``--prompts`` x ``--group-size`` samples.
``parallel.always_shard``: the single rank builds the mesh and ``fully_shard``s the policy;
``--precision bf16``: FSDP2 ``param_dtype`` bf16 (a bf16 frozen base, fp32 LoRA) and bf16 autocast.
Peak: ``--peak-tflops`` (H200 dense bf16: 989), on a CPU the fp32 matmul rate measured here.
Prints one JSON object and writes it to ``--out/grpo_real_shapes.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = "configs/bench/flowgrpo_tiny_sd3.yaml"
# model.overrides of the tiny SD3 preset for each shape (None: the config's own), and the asset shape
# (benchmarks/bench_assets.py)
SHAPES = {
    "sd3_medium": (dict(num_layers=24, num_attention_heads=24, attention_head_dim=64, caption_projection_dim=1536,
                        patch_size=2, qk_norm="rms_norm"), "SD3_MEDIUM"),
    "tiny": (None, "TINY"),
}
PHASES = ("time_rollout_s", "time_decode_s", "time_reward_wait_s", "time_train_s")


class CountedUpdate:
    """Wraps a GRPO update so that one call's FLOPs are counted (``flops`` after the call, else None)."""

    def __init__(self, update):
        self.inner, self.flops = update, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            out = self.inner(*args, **kwargs)
        self.flops = counter.get_total_flops()
        return out


def run_mode(mode: str, args, assets: dict, peak_tflops: float) -> dict:
    """``--warmup`` + ``--iterations`` timed GRPO iterations and one FLOP-counted one, ``mode`` lora / full."""
    from posttrain.grpo.stage import GRPOConfig, GRPORun
    from pretrain.config import load_config
    from pretrain.runtime.loop import step_once
    from pretrain.runtime.profiling import peak_rss_mb
    from torch.utils.flop_counter import FlopCounterMode

    cuda = args.device == "cuda"
    run_dir = Path(args.work) / mode
    overrides = SHAPES[args.shape][0]
    model = [] if overrides is None else ["model.overrides={" + ", ".join(f"{k}: {v}" for k, v in overrides.items())
                                          + "}"]
    cfg = load_config(GRPOConfig, CONFIG, [
        f"run_dir={run_dir}", f"model.pretrained={assets['export']}", f"data.path={assets['data']}", *model,
        f"train.device={args.device}",
        f"train.threads={'null' if cuda else 2}", f"train.precision={args.precision}",
        f"parallel.param_dtype={args.precision}", "parallel.always_shard=true",
        f"policy.lora_rank={32 if mode == 'lora' else 0}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}", f"rollout.batch_size={args.prompts * args.group_size // 2}",
        f"train.batch_size={args.prompts * args.group_size // 2}", f"rollout.num_inference_steps={args.steps}",
        f"train.steps={args.warmup + args.iterations + 1}", "checkpoint.every=0", "eval.every=0",
        f"perf.compile={str(args.compile).lower()}"])
    run = GRPORun(cfg)
    for _ in range(args.warmup):
        step_once(run)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = [step_once(run) for _ in range(args.iterations)]  # each ends on .item() calls: the GPU is done
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    run.update = counted = CountedUpdate(run.update)
    with FlopCounterMode(display=False) as counter:
        step_once(run)
    total, train = counter.get_total_flops(), counted.flops
    med = {k: statistics.median(r[k] for r in rows) for k in ("samples_per_s", *PHASES)}
    out = {"mode": mode, "layout": run.ranks.describe(), "sharded": type(run.st.model).__name__.startswith("FSDP"),
           "samples_per_iteration": run.n, **med, "peak_memory_mb": round(peak, 1),
           "peak_memory_kind": "cuda max_memory_allocated" if cuda else "process peak RSS",
           "iteration_tflop": total / 1e12, "train_tflop": train / 1e12,
           "train_mfu": train / med["time_train_s"] / (peak_tflops * 1e12),
           "rollout_mfu": (total - train) / (med["time_rollout_s"] + med["time_decode_s"]) / (peak_tflops * 1e12),
           "ratio_min": min(r["ratio_min"] for r in rows), "ratio_max": max(r["ratio_max"] for r in rows),
           "reward_mean": [r["reward_mean"] for r in rows]}
    run.scorer.close()
    run.logger.close()
    del run, counted
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="sd3_medium")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/grpo_real_shapes")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="SDE sampling steps (rollout.num_inference_steps)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="perf.compile: torch.compile each block")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak (default: 989, an H200's bf16; on a CPU the fp32 matmul rate "
                         "measured here)")
    ap.add_argument("--pretrain-batch", type=int, default=8)
    args = ap.parse_args(argv)
    from benchmarks import bench_assets
    from benchmarks.low_precision_step import run as pretrain_step
    from omegaconf import OmegaConf

    from pretrain.models import ModelConfig

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group(args.backend)  # from torchrun's environment; init_distributed then skips
    peak = args.peak_tflops
    if peak is None:
        from benchmarks.kernel_rates import matmul_gflops

        peak = 989.0 if cuda else matmul_gflops(2048, 2048, 2048, torch.device("cpu"), 1.0) / 1e3
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    assets = {"export": work / "assets" / "export", "data": work / "assets" / "data"}
    model = ModelConfig(preset="tiny", overrides=SHAPES[args.shape][0] or dict(OmegaConf.load(CONFIG).model.overrides))
    t0 = time.perf_counter()
    bench_assets.build_assets(model, assets["export"], assets["data"], getattr(bench_assets, SHAPES[args.shape][1]),
                              emoji=False)
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "backend": dist.get_backend(), "shape": args.shape, "precision": args.precision,
           "peak_tflops": peak, "assets_s": round(time.perf_counter() - t0, 1), "modes": []}
    for mode in args.modes.split(","):
        res["modes"].append(run_mode(mode, args, assets, peak))
    res["pretrain_step"] = pretrain_step("bf16", args.shape, args.pretrain_batch, 5 if cuda else 2, 2 if cuda else 1,
                                         False, args.compile, torch.device(args.device), peak)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpo_real_shapes.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
