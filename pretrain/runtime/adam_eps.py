"""How much of Adam's update eps decides: the share of trainable elements (of those that have had a
non-zero gradient) whose denominator sqrt(v_hat) + eps is dominated by eps (sqrt(v_hat) < eps).

AdamW's step is lr * m_hat / (sqrt(v_hat) + eps) (Kingma & Ba 2015, Algorithm 1). Where the gradients'
RMS sqrt(v_hat) is far below eps, the step shrinks to lr * m_hat / eps: an element whose gradients are
1e-10 moves by ~lr * 1e-2 instead of ~lr. Pretraining gradients are rarely that small, but RL
fine-tuning gradients (advantage-weighted log-prob ratios averaged over every latent element, clipped)
often are, and then eps silently scales the learning rate down. The share is logged as
``adam_eps_dominated_frac``; choosing eps is discussed in docs/grpo.md.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: Above this share a warning is given once per run.
WARN_FRAC = 0.5


def eps_dominated_frac(optimizer: torch.optim.Optimizer) -> float:
    """The share in [0, 1] of the elements with Adam state that have had a gradient (v_hat > 0) whose
    sqrt(v_hat) < eps, with v_hat = ``exp_avg_sq`` / (1 - beta2^step) (the bias-corrected second moment)
    and each group's ``eps``. Elements whose gradient has always been exactly 0 (e.g. LoRA's A while B
    is still 0, or frozen-by-graph weights) are left out: eps decides nothing there. NaN before the
    first step (no state) or when no element has had a gradient. Works on this rank's shard of a DTensor; under a process
    group the counts are summed over all ranks (one all-reduce of two float64; collective: every rank
    calls it at the same step). One comparison and sum per parameter: cheap next to the step itself."""
    counts = None
    for group in optimizer.param_groups:
        eps, beta2 = float(group["eps"]), float(group["betas"][1])
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            if "exp_avg_sq" not in state:
                continue
            v = state["exp_avg_sq"]
            v = getattr(v, "_local_tensor", v)
            bias = 1.0 - beta2 ** float(state["step"])
            # sqrt(v / bias) < eps  <=>  v < eps^2 * bias (no sqrt, no copy of v)
            seen = v > 0
            row = torch.stack([(seen & (v < eps * eps * bias)).sum().double(), seen.sum().double()])
            counts = row if counts is None else counts + row.to(counts.device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        if counts is None:
            counts = torch.zeros(2, dtype=torch.float64)
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        counts = counts.to(device)
        torch.distributed.all_reduce(counts)
    if counts is None or float(counts[1]) == 0.0:
        return float("nan")
    return float(counts[0] / counts[1])


class EpsMonitor:
    """Computes :func:`eps_dominated_frac` every ``every`` optimizer steps (and at step 1; 0 = never) and
    warns once, naming the share and eps, when it exceeds :data:`WARN_FRAC`."""

    def __init__(self, every: int):
        self.every, self.warned = every, False

    def __call__(self, optimizer: torch.optim.Optimizer, step: int) -> dict:
        """``{"adam_eps_dominated_frac": share}`` at a due ``step``, else ``{}``."""
        if not self.every or not (step == 1 or step % self.every == 0):
            return {}
        frac = eps_dominated_frac(optimizer)
        if frac > WARN_FRAC and not self.warned:
            self.warned = True
            eps = optimizer.param_groups[0]["eps"]
            log.warning("step %d: Adam's eps=%.3g dominates the update denominator of %.0f%% of the trainable "
                        "elements (their gradients' RMS is below eps), which scales their learning rate down; "
                        "for RL fine-tuning set optim.eps well below the gradients' scale, e.g. 1e-15 "
                        "(docs/grpo.md, 'Adam's eps')", step, eps, 100 * frac)
        return {"adam_eps_dominated_frac": frac}
