"""Per-transition surrogates that read the old policy's Gaussian, not only its log-density: Flow-DPPO's
divergence mask and GRPO-Guard's normalised ratio. Every transition of the SDE sampler is Gaussian,
N(mean, step_std^2 I) with step_std = std_dev_t sqrt(-dt), the same std for the old and the new policy,
so their KL is exact and cheap: per element (mean - old_mean)^2 / (2 step_std^2).

All inputs are rows of transitions: ``log_prob``/``old_log_prob`` float ``[k]`` (the per-element-mean
log-density, Flow-GRPO's scale), ``mean``/``old_mean`` ``[k, *latent]``, ``step_std``/``std_dev_t`` ``[k]``
(> 0), ``advantages`` ``[k]``, ``mask`` bool ``[k]`` (False: left out). Losses are means over the kept rows.
"""

from __future__ import annotations

import torch

from posttrain.objectives.ppo import kl_to_reference


def _masked_mean(per: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (per * w).sum() / w.sum().clamp(min=1.0)


def _ratio_stats(ratio: torch.Tensor, sel: torch.Tensor) -> dict:
    r = ratio[sel] if sel.any() else ratio
    return {"ratio_min": float(r.min()), "ratio_mean": float(r.mean()), "ratio_max": float(r.max())}


def divergence_masked_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                           old_mean: torch.Tensor, step_std: torch.Tensor, advantages: torch.Tensor, *,
                           kl_threshold: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Flow-DPPO (Ping et al. 2026, arXiv 2606.11025; the reference code's KL-ADV mask): the unclipped
    surrogate -A r, r = exp(log_prob - old_log_prob), with a row's gradient blocked only when the exact
    per-step KL(new || old) (per-element mean) is at least ``kl_threshold`` **and** the update moves it
    further out: r > 1 with A > 0, or r < 1 with A < 0. A row whose KL is high but whose advantage pulls
    it back toward the old policy keeps its gradient (where PPO's clip would also block it). Returns
    (float32 loss, detached stats: ratio min/mean/max, ``kl_old`` mean and max, ``masked_frac``)."""
    ratio = torch.exp(log_prob.float() - old_log_prob.float())
    adv = advantages.float().detach()
    kl = kl_to_reference(mean, old_mean, step_std).detach()
    far = kl >= kl_threshold
    blocked = far & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    per = torch.where(blocked, torch.zeros_like(ratio), -adv * ratio)
    w = mask.float() if mask is not None else torch.ones_like(per)
    loss = _masked_mean(per, w)
    with torch.no_grad():
        sel = w > 0
        stats = {**_ratio_stats(ratio, sel), "kl_old": float(_masked_mean(kl, w)),
                 "kl_old_max": float(kl[sel].max()) if sel.any() else 0.0,
                 "masked_frac": float(blocked.float()[sel].mean()) if sel.any() else 0.0}
    return loss, stats


def normalized_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                         old_mean: torch.Tensor, step_std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's RatioNorm (Wang et al. 2025, arXiv 2510.22319), float32 ``[k]``:
    (log_prob - old_log_prob + b) * step_std with b = mean((mean - old_mean)^2) / (2 step_std^2). With the
    next latent x' = old_mean + step_std * eps this equals mean(eps * (mean - old_mean)) exactly: zero
    mean over the noise at every step (the raw log-ratio's mean is -b, below 0, and its spread grows as
    step_std shrinks), so PPO's clip range means the same thing at every step."""
    b = kl_to_reference(mean, old_mean, step_std)
    return (log_prob.float() - old_log_prob.float() + b) * step_std.float()


def guarded_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                      old_mean: torch.Tensor, step_std: torch.Tensor, std_dev_t: torch.Tensor, *,
                      advantages: torch.Tensor, clip_range: float, reweight: bool = True,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO-Guard: PPO-clip on the normalised ratio (:func:`normalized_log_ratio`), each row weighted by
    1 / |dt| = (std_dev_t / step_std)^2 when ``reweight`` (the ``sde`` step's step_std = std_dev_t
    sqrt(|dt|); the ``grpo_guard`` part refuses other steps with it) (the paper's per-step gradient re-weighting, in
    the form verl-omni and Flow-Factory use), the weighted mean over kept rows. Returns (float32 loss,
    detached stats: ratio min/mean/max, ``clip_frac``, ``step_weight_mean``)."""
    ratio = torch.exp(normalized_log_ratio(log_prob, old_log_prob, mean, old_mean, step_std))
    adv = advantages.float()
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    weight = (std_dev_t.float() / step_std.float()).square() if reweight else torch.ones_like(per)
    w = mask.float() if mask is not None else torch.ones_like(per)
    loss = _masked_mean(per * weight, w)
    with torch.no_grad():
        sel = w > 0
        stats = {**_ratio_stats(ratio, sel), "step_weight_mean": float(_masked_mean(weight, w)),
                 "clip_frac": float(((ratio - 1).abs() > clip_range).float()[sel].mean()) if sel.any() else 0.0}
    return loss, stats
