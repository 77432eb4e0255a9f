"""Cost of recording log-probs: SDE rollout (Flow-GRPO step + per-step log-prob + trajectory buffer)
over plain Euler ODE sampling of the same model, batch, step count and CFG, in one process.

    python benchmarks/rollout_overhead.py [--preset small] [--batch 64] [--steps 10] [--repeats 5]

Prints seconds per sampling pass for both and their ratio (goal <= 1.05). The model is the preset with
random weights (the cost does not depend on the weights); prompt embeddings are random.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretrain.codec import PatchifyCodec
from pretrain.models import ModelConfig
from pretrain.models.sd3 import SD3Adapter, build_transformer
from pretrain.sampling import initial_noise, sample_latents
from pretrain.schedule import sigma_schedule
from pretrain.text_encoder import PromptEmbeds
from rollout.config import RolloutConfig
from rollout.sampler import Sampler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--guidance-scale", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = SD3Adapter(build_transformer(ModelConfig(preset=a.preset), a.size, 3, 384, 384)).to(dev).eval()
    codec = PatchifyCodec()
    g = torch.Generator().manual_seed(1)
    embeds = PromptEmbeds(torch.randn(a.batch, 24, 384, generator=g), torch.randn(a.batch, 384, generator=g))
    null = PromptEmbeds(torch.randn(1, 24, 384, generator=g), torch.randn(1, 384, generator=g))
    sampler = Sampler(RolloutConfig(noise_level=0.7, guidance_scale=a.guidance_scale), sigma_schedule(a.steps), null)

    def euler(it: int):
        noise = initial_noise(a.batch, (3, a.size, a.size), 0, step=it, device=dev)
        return codec.decode(sample_latents(model, embeds.to(dev), null.to(dev), noise, a.steps, a.guidance_scale))

    def sde(it: int):
        return sampler.sample(model, codec, embeds, [""] * a.batch, group_ids=torch.zeros(a.batch, dtype=torch.long),
                              sample_ids=list(range(a.batch)), latent_shape=(3, a.size, a.size), seed=0, iteration=it,
                              device=dev)

    def timed(fn) -> list[float]:
        fn(0)  # warm-up
        out = []
        for i in range(a.repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i + 1)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    # interleave to share machine drift between the two
    te, ts = [], []
    for _ in range(2):
        te += timed(euler)
        ts += timed(sde)
    me, ms = statistics.median(te), statistics.median(ts)
    print(f"preset {a.preset}, batch {a.batch}, {a.steps} steps, CFG {a.guidance_scale}, device {dev}, "
          f"{a.threads} threads")
    print(f"euler ODE sampling:        {me:.3f} s/pass (median of {len(te)})")
    print(f"SDE rollout + log-probs:   {ms:.3f} s/pass (median of {len(ts)})")
    print(f"ratio SDE / Euler:         {ms / me:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
