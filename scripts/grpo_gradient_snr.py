"""Is a reward learnable at this batch size? The agreement of GRPO gradient estimates from independent
rollout batches, at fixed weights.

    python scripts/grpo_gradient_snr.py CONFIG [--batches 6] [key=value ...]

Runs ``--batches`` GRPO iterations of CONFIG (overrides as for ``posttrain grpo``) without ever stepping
the optimizer: each iteration samples fresh rollouts (new prompts, new noise), computes the policy
loss's gradient over its mini-batches and records it, so every estimate is taken at the same weights.
Prints each iteration's rewards and, over all pairs of estimates g_i, g_j, the mean cosine
cos(g_i, g_j) with its standard error. With g = s + n_i (signal s, independent noise n_i), the mean
cosine estimates |s|^2 / (|s|^2 + E|n|^2): about 0 when one iteration's gradient is mostly noise, and
the iteration size needed for a given agreement scales with 1 / cosine. Also prints
|mean of g_i| / mean |g_i| (1 / sqrt(batches) for pure noise, 1 for a noiseless gradient).

Measured on 2 CPU cores (``configs/grpo/moving_emoji_video.yaml``: 64 videos per estimate, 6
estimates, from an 800-step frame-coded base at held-out ``motion_direction`` 0.85): a mean-brightness
reward (``tests/integration/test_video.py``) 0.057 (SE 0.011), ``motion_direction`` 0.014 (SE 0.008),
``motion_displacement`` -0.001 (SE 0.009). The run directory gets no checkpoint and no export.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.grpo import GRPOConfig, GRPORun  # noqa: E402
from pretrain.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.batches < 2:
        ap.error("--batches: at least 2 estimates are needed for a cosine")
    cfg = load_config(GRPOConfig, a.config, [*a.overrides, "checkpoint.every=0", f"train.steps={a.batches + 1}"])
    run = GRPORun(cfg)
    grads: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []

    def record(loss_value: float) -> dict:  # replaces the optimizer step: keep the gradient, leave the weights
        g = torch.cat([p.grad.detach().flatten().float().cpu() for p in run.rt.params if p.grad is not None])
        pending.append(g)
        run.rt.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(g.norm()), "lr": 0.0, "skipped": 0, "nonfinite": "", "nonfinite_total": 0,
                "amp_overflows": 0}

    run.rt.optimizer_step = record
    for i in range(a.batches):
        metrics = run.iteration()
        grads.append(torch.stack(pending).sum(0))
        pending.clear()
        rewards = {k[len("reward/"):-len("_mean")]: round(v, 4) for k, v in metrics.items()
                   if k.startswith("reward/") and k.endswith("_mean")}
        print(f"estimate {i + 1}: rewards {rewards}; |g| {float(grads[-1].norm()):.4g}", flush=True)
    run.scorer.close()
    unit = [g / g.norm().clamp(min=1e-30) for g in grads]
    cos = torch.tensor([float(u @ v) for u, v in itertools.combinations(unit, 2)])
    # pairs share estimates, so the SE over the K estimates' mean cosines is the honest one
    per = torch.tensor([float(sum(unit[i] @ unit[j] for j in range(len(unit)) if j != i)) / (len(unit) - 1)
                        for i in range(len(unit))])
    se = float(per.std()) / math.sqrt(len(per))
    mean_ratio = float(torch.stack(grads).mean(0).norm() / torch.stack([g.norm() for g in grads]).mean())
    print(f"pairwise cosine of {len(grads)} gradient estimates: mean {float(cos.mean()):.4f} (SE {se:.4f}), "
          f"sd {float(cos.std()):.4f}")
    print(f"|mean g| / mean |g|: {mean_ratio:.4f} (pure noise: {1 / math.sqrt(len(grads)):.4f}; no noise: 1)")


if __name__ == "__main__":
    main()
