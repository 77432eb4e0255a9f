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

The run writes into a temporary folder (the config's ``run_dir`` is left alone); fp16 is refused
(its gradients carry the loss scale). The SE is the jackknife's: each estimate enters K - 1 pairs.

Measured on 2 CPU cores with ``configs/grpo/moving_emoji_video.yaml`` and ``rollout.prompts_per_step=8
rollout.group_size=8 train.batch_size=32 train.grad_accum=1 rollout.shared_initial_noise=false
data.motions_per_emoji=6 model.pretrained=<an 800-step frame-coded base>`` (64 videos per estimate, 6
estimates, two optimizer-step gradients summed): a mean-brightness reward
(``tests/integration/test_video.py``) 0.057 (SE 0.027), ``motion_direction`` 0.014 (SE 0.021),
``motion_displacement`` -0.001 (SE 0.022).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.grpo.stage import GRPOConfig, GRPORun  # noqa: E402

from pretrain.runtime.loop import step_once  # noqa: E402
from pretrain.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    if a.batches < 3:
        ap.error("--batches: at least 3 estimates are needed for a cosine and its SE")
    with tempfile.TemporaryDirectory(prefix="grpo_gradient_snr_") as tmp:
        measure(a.config, a.overrides, a.batches, tmp)


def measure(config: str, overrides: list[str], batches: int, run_dir: str) -> None:
    """Run ``batches`` non-stepping GRPO iterations of ``config`` in ``run_dir`` and print the agreement."""
    cfg = load_config(GRPOConfig, config, [*overrides, f"run_dir={run_dir}", "checkpoint.every=0",
                                           f"train.steps={batches + 1}"])
    if cfg.train.precision == "fp16":
        raise SystemExit("train.precision: fp16 gradients carry the loss scale; use fp32 or bf16")
    run = GRPORun(cfg)
    grads: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []

    def record(loss_value: float) -> dict:  # replaces the optimizer step: keep the gradient, leave the weights
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float().cpu()
                       for p in run.rt.params])
        if not torch.isfinite(g).all():
            raise SystemExit(f"non-finite gradient in estimate {len(grads) + 1}")
        pending.append(g)
        run.rt.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(g.norm()), "lr": 0.0, "skipped": 0, "nonfinite": "", "nonfinite_total": 0,
                "amp_overflows": 0}

    run.rt.optimizer_step = record
    for i in range(batches):
        metrics = step_once(run)
        grads.append(torch.stack(pending).sum(0))
        pending.clear()
        rewards = {k[len("reward/"):-len("_mean")]: round(v, 4) for k, v in metrics.items()
                   if k.startswith("reward/") and k.endswith("_mean")}
        print(f"estimate {i + 1}: rewards {rewards}; |g| {float(grads[-1].norm()):.4g}", flush=True)
    run.scorer.close()
    unit = torch.stack([g / g.norm().clamp(min=1e-30) for g in grads])
    k = len(unit)
    gram = unit @ unit.T
    cos = gram[tuple(torch.triu_indices(k, k, 1))]  # each pair once
    # jackknife: leaving estimate i out drops its K - 1 pairs; the pairs share estimates, so the naive SE is too small
    per = (gram.sum(1) - gram.diagonal()) / (k - 1)
    loo = (k * float(cos.mean()) - 2 * per) / (k - 2)
    se = math.sqrt((k - 1) / k * float(((loo - loo.mean()) ** 2).sum()))
    mean_ratio = float(torch.stack(grads).mean(0).norm() / torch.stack([g.norm() for g in grads]).mean())
    print(f"pairwise cosine of {len(grads)} gradient estimates: mean {float(cos.mean()):.4f} (SE {se:.4f}), "
          f"sd {float(cos.std()):.4f}")
    print(f"|mean g| / mean |g|: {mean_ratio:.4f} (pure noise: {1 / math.sqrt(len(grads)):.4f}; no noise: 1)")


if __name__ == "__main__":
    main()
