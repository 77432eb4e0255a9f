"""bf16 against low-precision training steps of an SD3 transformer with random weights: seconds per step,
peak memory and MFU, each recipe measured in the same run (ratios against the bf16 row).

    python benchmarks/low_precision_step.py --shape sd3_medium --recipes bf16,fp8_rowwise,fp8_tensorwise \
        [--batch 8] [--steps 10] [--compile] [--json out.json]       # on a GPU (H100 / H200 for FP8)
    python benchmarks/low_precision_step.py --shape tiny --emulate   # on CPU: the same code path, tiny

``sd3_medium``: SD3.5-Medium's transformer shapes (24 joint blocks, 24 heads x 64, 16 latent channels,
patch 2) at 512 px: 64 x 64 latents = 1024 image tokens, 333 text tokens (77 CLIP + 256 T5), bf16
parameters, AdamW. A step is forward, flow-matching loss, backward and optimizer step. FLOPs are counted,
not estimated from parameter counts: 2 x in x out per token for every Linear that runs (forward hooks),
plus 4 x sequence^2 x head_dim per head for each joint attention, times 3 for forward + backward; MFU is
that over the step time and ``--peak-tflops`` (H200 dense bf16: 989). The MFU of an FP8 row is against the
same bf16 peak, so rows compare as speed. Prints a table and, with ``--json``, writes every number.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import pretrain  # noqa: F401  (before diffusers: filters torchao's start-up log noise)

SHAPES = {  # SD3Transformer2DModel config, latent side, text tokens
    "sd3_medium": (dict(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                        caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192,
                        qk_norm="rms_norm"), 64, 333),
    "tiny": (dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=32,
                  num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
                  pos_embed_max_size=32), 16, 24),
}


def _flop_counter(model: torch.nn.Module, heads: int, head_dim: int, seq: int, batch: int, layers: int):
    """A list the hooks add every Linear's forward FLOPs to; attention FLOPs are added per step."""
    count = [0.0]

    def hook(mod, inputs, _out):
        count[0] += 2.0 * inputs[0].numel() * mod.out_features  # 2 x tokens x in x out

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    attention = layers * batch * heads * 4.0 * seq * seq * head_dim  # QK^T and PV, 2 FLOPs per MAC
    return count, attention, handles


def run(recipe: str, shape: str, batch: int, steps: int, warmup: int, emulate: bool, compile_blocks: bool,
        device: torch.device, peak_tflops: float, lr: float = 1e-5) -> dict:
    from diffusers import SD3Transformer2DModel

    from pretrain.runtime.low_precision import LowPrecisionConfig, convert

    config, side, text = SHAPES[shape]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = SD3Transformer2DModel.from_config(config, torch_dtype=dtype).to(device)
    converted = convert(model, LowPrecisionConfig(recipe=recipe, emulate=emulate)) if recipe != "bf16" else []
    if compile_blocks:
        for block in model.transformer_blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(batch, config["in_channels"], side, side, generator=g).to(device, dtype)
    text_embeds = torch.randn(batch, text, config["joint_attention_dim"], generator=g).to(device, dtype)
    pooled = torch.randn(batch, config["pooled_projection_dim"], generator=g).to(device, dtype)
    timestep = torch.rand(batch, generator=g).to(device) * 1000
    seq = (side // config["patch_size"]) ** 2 + text
    flops, attention, handles = _flop_counter(model, config["num_attention_heads"], config["attention_head_dim"],
                                              seq, batch, config["num_layers"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(warmup + steps):
        flops[0] = 0.0
        sync()
        start = time.perf_counter()
        out = model(hidden_states=latents, encoder_hidden_states=text_embeds, pooled_projections=pooled,
                    timestep=timestep).sample
        loss = (out.float() - latents.float()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    for h in handles:
        h.remove()
    step_s = sorted(times)[len(times) // 2]
    step_flops = 3 * (flops[0] + attention)
    return {"recipe": recipe, "shape": shape, "batch": batch, "tokens": seq, "converted_layers": len(converted),
            "step_s": step_s, "tflops_per_step": step_flops / 1e12,
            "mfu": step_flops / step_s / (peak_tflops * 1e12),
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            "losses": losses, "emulate": emulate, "compile": compile_blocks, "device": str(device)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="sd3_medium")
    p.add_argument("--recipes", default="bf16,fp8_rowwise,fp8_tensorwise", help="comma-separated; bf16 = none")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--emulate", action="store_true", help="torchao's emulation (CPU, or a GPU without FP8)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (fuses the FP8 casts)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (the same batch every step)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H200: 989)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for recipe in args.recipes.split(","):
        rows.append(run(recipe, args.shape, args.batch, args.steps, args.warmup, args.emulate, args.compile, device,
                        args.peak_tflops, args.lr))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["step_s"]
    print(f"{'recipe':16} {'layers':>6} {'step s':>8} {'x bf16':>7} {'MFU':>6} {'peak GB':>8}  loss")
    for r in rows:
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        print(f"{r['recipe']:16} {r['converted_layers']:>6} {r['step_s']:>8.3f} {base / r['step_s']:>7.2f} "
              f"{r['mfu']:>6.1%} {mem:>8}  {r['losses'][-1]:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
