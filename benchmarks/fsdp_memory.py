"""Per-rank training-state memory under each parallel layout: parameter + gradient + AdamW-state bytes
held by one rank, over the same in one process, on CPU gloo ranks. Layouts: FSDP2 over 2 and 4 ranks,
tensor parallelism over 4 (TP 4), and TP 2 x FSDP 2 on 4 ranks; with ``--model hidream`` (a mixture-of-experts
HiDream transformer: 4 blocks of width 128, 8 routed experts, 2 active, plus a shared one) FSDP 2 / 4 and expert
parallelism, EP 2 on 2 ranks and EP 2 x FSDP 2 on 4, with the routed experts' share of each rank's bytes. The
last column is the largest FSDP2 unit unsharded, what a rank all-gathers on top to run it: a block with all
its experts under FSDP, a block without them (or one layer's local experts) under EP.

    python benchmarks/fsdp_memory.py [--preset small] [--lora-rank 0] [--layouts fsdp2,fsdp4,tp4,tp2xfsdp2]
    python benchmarks/fsdp_memory.py --model hidream [--layouts fsdp2,fsdp4,ep2,ep2xfsdp2]

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


LAYOUTS = {"fsdp2": (2, {}), "fsdp4": (4, {}), "tp4": (4, {"dp_shard": 1, "tp": 4}), "tp2xfsdp2": (4, {"tp": 2}),
           "ep2": (2, {"ep": 2}), "ep2xfsdp2": (4, {"ep": 2})}
DEFAULT_LAYOUTS = {"sd3": "fsdp2,fsdp4,tp4,tp2xfsdp2", "hidream": "fsdp2,fsdp4,ep2,ep2xfsdp2"}


def hidream_model() -> tuple[torch.nn.Module, tuple]:
    """The mixture-of-experts model of the module notes (seed 0) and a batch of 2 (64 image tokens each)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImageTransformer2DModel

    from pretrain.models.hidream import HiDreamAdapter

    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=4, caption_channels=[64, 64], text_emb_dim=64, num_routed_experts=8,
        num_activated_experts=2, axes_dims_rope=(16, 8, 8), max_resolution=(64, 64), llama_layers=[0, 1, 2, 3])
    model = HiDreamAdapter(transformer, FlowMatchEulerDiscreteScheduler(), 8, 64, 64, 4)
    embeds = PromptEmbeds(torch.randn(2, 8 + 4 * 8, 64), torch.randn(2, 64))
    return model, (torch.randn(2, 4, 16, 16), torch.rand(2), embeds)


def measure(rank: int, world: int, preset: str, lora_rank: int, dims: dict, family: str = "sd3") -> dict:
    from pretrain.models.sd3 import SD3_PRESETS

    if family == "hidream":
        model, inputs = hidream_model()
        parallelize(model, ParallelDims(**dims).build_mesh(), ParallelConfig())
        return _step(model, inputs)
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
    embeds = PromptEmbeds(torch.randn(2, 8, TEXT_DIM), torch.randn(2, TEXT_DIM))
    return _step(model, (torch.randn(2, 3, SIZE, SIZE), torch.rand(2), embeds))


def _local_bytes(tensors) -> int:
    """Bytes of the local shards themselves (no storage sharing: FSDP2's gradients are views of one buffer)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _largest_unit(model: torch.nn.Module) -> int:
    """Bytes of the largest FSDP2 unit unsharded: what a rank all-gathers to run one block (or one layer's
    local experts under EP) on top of what it holds."""
    from torch.distributed.fsdp import FSDPModule

    states = {id(s): s for m in model.modules() if isinstance(m, FSDPModule) for s in [m._get_fsdp_state()]}
    groups = [s._fsdp_param_group for s in states.values() if s._fsdp_param_group is not None]
    return max(sum(fp._orig_size.numel() * fp.sharded_param.element_size() for fp in g.fsdp_params) for g in groups)


def _step(model: torch.nn.Module, inputs: tuple) -> dict:
    """One forward / backward / AdamW step; the bytes this rank then holds, those of its routed experts
    (parameters, gradients and AdamW state of their local shards) and of its largest unsharded unit."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    model(*inputs).pow(2).mean().backward()
    opt.step()
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    expert_states = [v for p in experts for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    return dict(params=_bytes(model.parameters()), grads=_bytes(p.grad for p in trainable), optim=_bytes(states),
                experts=_local_bytes([*experts, *(p.grad for p in experts if p.grad is not None), *expert_states]),
                unit=_largest_unit(model))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sd3", choices=sorted(DEFAULT_LAYOUTS))
    ap.add_argument("--preset", default="small", help="SD3 preset (--model sd3)")
    ap.add_argument("--lora-rank", type=int, default=0, help="--model sd3")
    ap.add_argument("--layouts", default=None, help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = ap.parse_args()
    args.layouts = args.layouts or DEFAULT_LAYOUTS[args.model]
    names = ["1 process"] + [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names[1:] if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    per_rank = {n: run_ranks(measure, args.preset, args.lora_rank, LAYOUTS.get(n, (1, {}))[1], args.model,
                             world_size=LAYOUTS.get(n, (1, {}))[0]) for n in names}
    model = "HiDream MoE" if args.model == "hidream" else f"preset {args.preset} (4 heads)"
    print(f"{model}, {'LoRA r ' + str(args.lora_rank) if args.lora_rank else 'full fine-tuning'}, "
          f"fp32, CPU gloo; bytes held per rank")
    total = lambda r: r["params"] + r["grads"] + r["optim"]  # noqa: E731
    print(f"{'layout':>10} {'rank':>4} {'params':>12} {'grads':>12} {'optim':>12} {'total':>12} {'routed experts':>15} "
          f"{'largest unit':>13}")
    for n, results in per_rank.items():
        for rank, r in enumerate(results):
            print(f"{n:>10} {rank:>4} {r['params']:>12,} {r['grads']:>12,} {r['optim']:>12,} {total(r):>12,} "
                  f"{r['experts']:>15,} {r['unit']:>13,}")
    base = total(per_rank["1 process"][0])
    for n in names[1:]:
        worst = max(total(r) for r in per_rank[n])
        goal = " (goal <= 0.55)" if n == "fsdp2" else ""
        print(f"max per-rank bytes, {n} / 1 process: {worst / base:.4f} (ideal {1 / LAYOUTS[n][0]:.2f}){goal}")


if __name__ == "__main__":
    main()
