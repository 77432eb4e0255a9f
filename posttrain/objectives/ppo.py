"""GRPO losses: PPO-clip on per-transition log-prob ratios and the KL to the reference policy.

PPO-clip: Schulman et al. 2017 (arXiv 1707.06347, eq. 7), as Flow-GRPO applies it per denoising
transition (arXiv 2505.05470, eq. 8). KL: the exact KL between the policy's and the reference's
Gaussian transitions N(mu, std^2), averaged over elements: (mu_theta - mu_ref)^2 / (2 std^2), with std the
transition's own std (the one its noise is drawn with: std_dev_t * sqrt(|dt|) for Flow-GRPO's SDE, as the
paper's KL and flow_grpo's implementation take it).
"""

from __future__ import annotations

import torch


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate, float32 scalar: mean over unmasked samples of
    max(-A * ratio, -A * clip(ratio, 1 - clip_range, 1 + clip_range)), ratio = exp(log_prob - old).

    All inputs ``[B]``; ``mask`` bool ``[B]`` (False = excluded, e.g. NaN reward). Returns the loss and
    detached stats: ratio min/mean/max, clip fraction, approx-KL 0.5 * E[(log_prob - old)^2]."""
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    w = mask.float() if mask is not None else torch.ones_like(per)
    denom = w.sum().clamp(min=1.0)
    loss = (per * w).sum() / denom
    with torch.no_grad():
        sel = w > 0
        r = ratio[sel] if sel.any() else ratio
        stats = {"ratio_min": float(r.min()), "ratio_mean": float(r.mean()), "ratio_max": float(r.max()),
                 "clip_frac": float(((ratio - 1).abs() > clip_range).float()[sel].mean()) if sel.any() else 0.0,
                 "approx_kl": float((0.5 * log_ratio.square() * w).sum() / denom)}
    return loss, stats


def masked_reference_kl(new, ref, mask: torch.Tensor) -> torch.Tensor:
    """float32 scalar: the mean over rows where ``mask`` (bool ``[k]``) of :func:`kl_to_reference` between
    the policy's and the reference's steps ``new`` / ``ref`` (:class:`rollout.sde.SDEStep`, the policy's
    ``step_std``): the beta term of Flow-GRPO's loss (eq. 8)."""
    w = mask.float()
    return (kl_to_reference(new.mean, ref.mean, new.step_std) * w).sum() / w.sum().clamp(min=1.0)


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, step_std: torch.Tensor) -> torch.Tensor:
    """float32 ``[B]``: per-element mean of (mean - ref_mean)^2 / (2 step_std^2), the KL between
    N(mean, step_std^2) and N(ref_mean, step_std^2) per element; ``mean``/``ref_mean`` ``[B, ...]``,
    ``step_std`` ``[B]`` (> 0: only stochastic transitions are trained)."""
    sq = (mean.float() - ref_mean.float()).square().flatten(1).mean(1)
    return sq / (2 * step_std.float().square())
