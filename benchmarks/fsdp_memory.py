"""Per-rank training-state memory under FSDP2: parameter + gradient + AdamW-state bytes held by one rank
with the model sharded over N = 2 gloo ranks, over the same at N = 1, on CPU.

    python benchmarks/fsdp_memory.py [--preset small] [--lora-rank 0]

Counts the local shards (``DTensor.to_local()``) after one forward/backward and one AdamW step, so the
numbers are what each rank keeps between steps (activations and the transient all-gathered block are
not counted), by the storages behind them, so FSDP2's padding counts. Goal: ratio <= 0.55 (ideal 0.5; FSDP2 pads each parameter's dim 0 to a multiple of N).
With ``--lora-rank R`` the base is frozen and only the adapters train.
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


def measure(rank: int, world: int, preset: str, lora_rank: int) -> dict:
    torch.manual_seed(0)
    model = SD3Adapter(build_transformer(ModelConfig(preset=preset), SIZE, 3, TEXT_DIM, TEXT_DIM))
    if lora_rank:
        from peft import LoraConfig

        from pretrain.models.sd3 import SD3_ATTENTION

        model.requires_grad_(False)
        model.transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=SD3_ATTENTION))
    parallelize(model, ParallelDims().build_mesh(), ParallelConfig())
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
    args = ap.parse_args()
    per_rank = {n: run_ranks(measure, args.preset, args.lora_rank, world_size=n) for n in (1, 2)}
    print(f"preset {args.preset}, {'LoRA r ' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, "
          f"fp32, CPU gloo; bytes held per rank")
    print(f"{'N':>2} {'rank':>4} {'params':>12} {'grads':>12} {'optim':>12} {'total':>12}")
    for n, results in per_rank.items():
        for rank, r in enumerate(results):
            print(f"{n:>2} {rank:>4} {r['params']:>12,} {r['grads']:>12,} {r['optim']:>12,} {sum(r.values()):>12,}")
    base = sum(per_rank[1][0].values())
    worst = max(sum(r.values()) for r in per_rank[2])
    print(f"max per-rank bytes at N=2 / N=1: {worst / base:.4f} (goal <= 0.55)")


if __name__ == "__main__":
    main()
