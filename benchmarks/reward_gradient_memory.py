"""Activation memory of DRaFT-K / AlignProp with and without gradient checkpointing: measured on the
project's tiny and small presets, computed for SD3.5-M's shapes.

What is counted: the bytes autograd keeps for the backward pass after the loss's forward (every tensor
saved for backward, counted once per storage, through ``torch.autograd.graph.saved_tensors_hooks``),
plus, with checkpointing, the input state each checkpointed step keeps to recompute from. Weights,
gradients and optimizer state are not activations and are left out. SD3.5-M's rows are computed from the
standard per-layer activation count (see ``main``) at 1024 px (128 x 128 latents, 333 text tokens),
bf16, batch 1, CFG off; with checkpointing the peak adds one step's activations while it is recomputed.

    python benchmarks/reward_gradient_memory.py [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from posttrain.objectives.reward_gradient import Chain  # noqa: E402
from pretrain.models import ModelConfig  # noqa: E402
from pretrain.models.sd3 import SD3Adapter, build_transformer  # noqa: E402
from pretrain.schedule import sigma_schedule  # noqa: E402
from pretrain.text_encoder import PromptEmbeds  # noqa: E402

class SavedBytes:
    """Bytes of the tensors autograd saves while the context is open, one count per storage, leaving out
    ``skip`` (the storages of the weights, which are not activations)."""

    def __init__(self, skip: set[int]):
        self.bytes, self.seen = 0, set(skip)

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def measure(model, x: torch.Tensor, embeds: PromptEmbeds, steps: int, k: int, checkpoint: bool) -> float:
    """MiB kept for backward after DRaFT-K's forward through ``steps`` Euler steps (``k`` with gradient)."""
    chain = Chain(lambda z, s: model(z, s, embeds), sigma_schedule(steps, 1.0).to(x.device, x.dtype), x,
                  lambda z: z, lambda images: -images.float().square().flatten(1).mean(1), checkpoint)
    n = chain.num_steps
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with SavedBytes(weights) as saved:  # draft_k's forward (posttrain.objectives.reward_gradient.draft_k), no .item()
        with torch.no_grad():
            start = chain.run(0, n - k, chain.noise)
        loss = -chain.score(chain.run(n - k, n, start.detach())).mean()
    kept = saved.bytes + (k * x.numel() * x.element_size() if checkpoint else 0)  # each step's input state
    del loss
    return kept / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    print("| model | latents | K | checkpoint | activation MiB |\n|---|---|---:|---|---:|")
    for preset, size in (("tiny", 16), ("small", 32)):
        torch.manual_seed(0)
        model = SD3Adapter(build_transformer(ModelConfig(preset=preset), size, 3, 384, 384))
        x = torch.randn(8, 3, size, size)
        embeds = PromptEmbeds(torch.randn(8, 24, 384), torch.randn(8, 384))
        for k in (1, 4, a.steps):
            for ckpt in (False, True):
                print(f"| {preset} (batch 8) | 3x{size}x{size} | {k} | {ckpt} | "
                      f"{measure(model, x, embeds, a.steps, k, ckpt):.1f} |")
    # SD3.5-M, computed: activations of one transformer layer ~ 34 s h bytes per sample in 16-bit with a
    # fused (flash) attention that keeps no s x s matrix (Korthikanti et al. 2022, arXiv 2205.05198, eq. 1
    # without its 5 a s^2 term); s = 4096 image + 333 text tokens, h = 1536, 24 joint layers, the first 13
    # with a second (image-only) attention, counted as a third of a layer more each.
    s_tokens, h, layers = 4096 + 333, 1536, 24 + 13 / 3
    per_step = 34 * s_tokens * h * layers / 2**20  # MiB, batch 1, no CFG (CFG doubles the rows)
    state = 16 * 128 * 128 * 2 / 2**20
    for k in (1, 4, a.steps):
        print(f"| SD3.5-M (computed, bf16, batch 1) | 16x128x128 | {k} | False | {k * per_step:.0f} |")
        print(f"| SD3.5-M (computed, bf16, batch 1) | 16x128x128 | {k} | True | {k * state:.1f} kept + "
              f"{per_step:.0f} while one step is recomputed |")


if __name__ == "__main__":
    main()
