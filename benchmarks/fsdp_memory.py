"""Per-rank training-state memory under each parallel layout: parameter + gradient + AdamW-state bytes
held by one rank, over the same in one process, on CPU gloo ranks. Layouts: FSDP2 over 2 and 4 ranks,
tensor parallelism over 4 (TP 4), and TP 2 x FSDP 2 on 4 ranks.

    python benchmarks/fsdp_memory.py [--preset small] [--lora-rank 0] [--layouts fsdp2,fsdp4,tp4,tp2xfsdp2]

The model is the preset with 4 heads of width / 4 (the small preset's 3 heads do not split over 2 or 4
TP ranks; same width and parameter count). Counts the local shards (``DTensor.to_local()``) after one
forward/backward and one AdamW step, so the numbers are what each rank keeps between steps (activations
and the transient all-gathered block are not counted), by the storages behind them, so FSDP2's padding
counts. Goal for FSDP 2: ratio <= 0.55 (ideal 0.5; FSDP2 pads each parameter's dim 0 to a multiple of N).
TP shards only the planned projections (``pretrain/parallel/tensor.py``); AdaLN modulation, embeddings
and norms stay replicated, which the TP rows show. With ``--lora-rank R`` the base is frozen and only
the adapters train.
"""

from __future__ import annotations

import argparse

import torch

from pretrain.models import ModelConfig
from pretrain.models.sd3 import SD3Adapter, build_transformer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from pretrain.text_encoder import PromptEmbeds

SIZE, TEXT_DIM = 32, 384  # the quickstart's resolution and MiniLM's width


def _bytes(tensors) -> int:
    """Bytes of the storages behind the local shards (FSDP2's padding included), each storage once."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


LAYOUTS = {"fsdp2": (2, {}), "fsdp4": (4, {}), "tp4": (4, {"dp_shard": 1, "tp": 4}), "tp2xfsdp2": (4, {"tp": 2})}


def measure(rank: int, world: int, preset: str, lora_rank: int, dims: dict) -> dict:
    from pretrain.models.sd3 import SD3_PRESETS

    torch.manual_seed(0)
    width = SD3_PRESETS[preset]["num_attention_heads"] * SD3_PRESETS[preset]["attention_head_dim"]
    cfg = ModelConfig(preset=preset, overrides={"num_attention_heads": 4, "attention_head_dim": width // 4})
    model = SD3Adapter(build_transformer(cfg, SIZE, 3, TEXT_DIM, TEXT_DIM))
    if lora_rank:
        from peft import LoraConfig

        from pretrain.models.sd3 import SD3_ATTENTION

        model.requires_grad_(False)
        model.transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=SD3_ATTENTION))
    parallelize(model, ParallelDims(**dims).build_mesh(), ParallelConfig())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    embeds = PromptEmbeds(torch.randn(2, 8, TEXT_DIM), torch.randn(2, TEXT_DIM))
    model(torch.randn(2, 3, SIZE, SIZE), torch.rand(2), embeds).pow(2).mean().backward()
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return dict(params=_bytes(model.parameters()), grads=_bytes(p.grad for p in trainable), optim=_bytes(states))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = ap.parse_args()
    names = ["1 process"] + [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names[1:] if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    per_rank = {n: run_ranks(measure, args.preset, args.lora_rank, LAYOUTS.get(n, (1, {}))[1],
                             world_size=LAYOUTS.get(n, (1, {}))[0]) for n in names}
    print(f"preset {args.preset} (4 heads), {'LoRA r ' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, "
          f"fp32, CPU gloo; bytes held per rank")
    print(f"{'layout':>10} {'rank':>4} {'params':>12} {'grads':>12} {'optim':>12} {'total':>12}")
    for n, results in per_rank.items():
        for rank, r in enumerate(results):
            print(f"{n:>10} {rank:>4} {r['params']:>12,} {r['grads']:>12,} {r['optim']:>12,} {sum(r.values()):>12,}")
    base = sum(per_rank["1 process"][0].values())
    for n in names[1:]:
        worst = max(sum(r.values()) for r in per_rank[n])
        goal = " (goal <= 0.55)" if n == "fsdp2" else ""
        print(f"max per-rank bytes, {n} / 1 process: {worst / base:.4f} (ideal {1 / LAYOUTS[n][0]:.2f}){goal}")


if __name__ == "__main__":
    main()
