"""One FSDP2-sharded GRPO step of the tiny preset on one rank, timed, with its peak memory.

Run under ``torchrun --nproc_per_node 1`` (``scripts/gpu_check.sh`` does): the process group uses
``--backend`` (nccl on a GPU, gloo for a CPU dry run) and ``parallel.always_shard`` makes the single
rank build the mesh and ``fully_shard`` the policy, so the sharded code path runs on one device.
Precision: FSDP2 ``param_dtype`` bf16 (a bf16 frozen base, fp32 LoRA) and bf16 autocast.

No downloads: a randomly initialised MiniLM-shaped BERT around the tokenizer files in ``--tokenizer``
and a generated shapes dataset (``benchmarks/gpu_check.py``), a 2-step pretraining run for the export.
Prints one JSON line: step time of each GRPO iteration (the first includes warm-up), peak memory
(CUDA: ``max_memory_allocated``; CPU: peak RSS) and the layout; also writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="folder of MiniLM tokenizer files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/fsdp_grpo_step")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--train-batch-size", type=int, default=32, help="training mini-batch (of 32 samples)")
    ap.add_argument("--grad-accum", type=int, default=1, help="mini-batches per optimizer step")
    args = ap.parse_args()
    from benchmarks.gpu_check import make_encoder, make_shapes
    from posttrain.grpo.stage import GRPOConfig, GRPORun
    from pretrain.runtime.loop import step_once
    from pretrain.runtime.profiling import peak_rss_mb
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig, train

    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(args.backend)  # from torchrun's environment; init_distributed then skips
    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    enc, data = make_encoder(Path(args.tokenizer), work / "encoder"), make_shapes(work / "shapes")
    base = ["data.source=folder", f"data.path={data}", "data.heldout_fraction=0.2", "data.limit=null",
            f"data.cache_dir={work / 'cache'}", f"train.device={args.device}", "train.threads=null"]
    export = train(load_config(PretrainConfig, "configs/pretrain/emoji_tiny.yaml", [
        f"run_dir={work / 'pre'}", *base, "data.size=32", f"text_encoder.path={enc}", "train.steps=2",
        "eval.every=0"]))
    cfg = load_config(GRPOConfig, "configs/grpo/emoji_tiny.yaml", [
        f"run_dir={work / 'grpo'}", f"model.pretrained={export}", *base, f"train.steps={args.iterations}",
        "parallel.always_shard=true", "parallel.param_dtype=bf16", "train.precision=bf16", "eval.every=0",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.batch_size=32",
        f"train.batch_size={args.train_batch_size}", f"train.grad_accum={args.grad_accum}"])
    run = GRPORun(cfg)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iterations):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_once(run)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 3))
    res = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "backend": dist.get_backend(), "layout": run.ranks.describe(),
           "sharded": type(run.st.model).__name__.startswith("FSDP"), "step_s": times,
           "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if args.device == "cuda"
           else round(peak_rss_mb(), 1),
           "peak_memory_kind": "cuda max_memory_allocated" if args.device == "cuda" else "process peak RSS"}
    run.scorer.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_grpo_step.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
