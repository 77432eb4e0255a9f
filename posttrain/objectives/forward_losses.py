"""The forward-process losses: trained on the noised clean samples of the rollouts, no log-probs.

Every loss here sees one draw of the forward process per sample: x0 the rollout's clean latent, eps
fresh noise, sigma a rollout-schedule sigma, x_t = (1 - sigma) x0 + sigma eps, and velocities
predicted at (x_t, sigma) by the policy (``v``, with gradient), the "old" sampling copy
(``v_old``) and the reference model (``v_ref``). Tensors ``[B, ...]`` (any float dtype, math in
float32), per-sample vectors ``[B]``. Each function returns float32 per-sample terms ``[B]`` or a
scalar, as its docstring says.
"""

from __future__ import annotations

import torch

from pretrain.flow import flow_matching_loss
from rollout.sde import per_sample


def masked_mean(per: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per`` ``[B]`` over ``mask`` (bool ``[B]``), 0 (with gradient) when nothing is
    selected. All-True masks give ``per.mean()`` bit for bit."""
    return per[mask].mean() if bool(mask.any()) else per.sum() * 0.0


def velocity_kl(v: torch.Tensor, v_other: torch.Tensor) -> torch.Tensor:
    """float32 ``[B]``: per-element mean of (v - v_other)^2, the velocity-space KL surrogate the
    forward-process methods use (DiffusionNFT and AWM reference code)."""
    return (v.float() - v_other.float()).square().flatten(1).mean(1)


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = clip(clip(A, +/-m) / m / 2 + 0.5, 0, 1), float32 ``[B]``
    in [0, 1] (``m`` = ``adv_clip_max``; A = 0 gives 0.5). Reference implementation:
    NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (the ``normalized_advantages_clip`` step)."""
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor,
             r: torch.Tensor, *, beta: float, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's per-sample policy loss, float32 ``[B]`` (Zheng et al. 2025, arXiv 2509.16117:
    the negative-aware objective with implicit positive and negative policies, in the form the
    reference implementation NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` trains it):

        v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v
        x0+- = x_t - sigma v+-,                 w+- = max(mean|x0+- - x0|, 1e-5)  (no gradient)
        L+- = mean((x0+- - x0)^2) / w+-
        loss = m (r L+ + (1 - r) L-) / beta     (m = ``adv_clip_max``)

    ``v_old`` has no gradient. With r = 0.5 and v == v_old the gradient is zero: v+ = v- and their
    pulls cancel. ``beta`` > 0 is the step size of the implicit positive and negative policies."""
    v, v_old, x0, x_t = v.float(), v_old.detach().float(), x0.float(), x_t.float()
    s = per_sample(sigma.float(), x0)
    positive = beta * v + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v

    def adaptive(pred_v: torch.Tensor) -> torch.Tensor:
        err = (x_t - s * pred_v) - x0
        weight = err.detach().abs().flatten(1).mean(1).clamp(min=1e-5)
        return err.square().flatten(1).mean(1) / weight

    r = r.float()
    return adv_clip_max * (r * adaptive(positive) + (1.0 - r) * adaptive(negative)) / beta


def awm_loss(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """Advantage Weighted Matching's policy loss (Xue et al. 2025, arXiv 2509.25050), float32 scalar, with
    the importance ratio at 1 as the reference code trains it (scxue/advantage_weighted_matching
    ``scripts/train_sd3_awm.py``: one optimizer step per rollout, so the ratio it clips is 1) and its
    plain squared error (the code's default weighting is a generalised Huber, ``ghuber``, not built here): the mean over ``mask`` of A_i * ||v_i - (eps_i - x0_i)||^2 / D, the pretraining
    flow-matching loss (:func:`pretrain.flow.flow_matching_loss`) of each clean sample weighted by its
    advantage. A = 1 everywhere gives that loss bit for bit; A = 0 gives zero gradient."""
    return masked_mean(advantages.float() * flow_matching_loss(v, x0, noise), mask)


def dgpo_group_margin(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
                      beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DGPO's group term s_g = (beta / G) sum_{i in g} A_i (e_i - e_ref,i) for each group g (Luo et al.
    2025, arXiv 2510.08425; reference code Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``, its per-group
    sums of ``advantages * beta_dpo * delta_diff / group_size``; G = the group's sample count), float32 ``[num groups]``, and the
    group order (``torch.unique`` of ``group_ids``). ``err``/``ref_err``: per-sample flow-matching
    errors ``[B]``. Positive-advantage samples that beat the reference (e < e_ref) make s_g negative."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    term = advantages.float() * (err.float() - ref_err.float())
    sums = torch.zeros(len(groups), dtype=torch.float32, device=err.device).index_add(0, inverse.to(err.device), term)
    counts = torch.bincount(inverse, minlength=len(groups)).to(err.device).float()
    return beta * sums / counts, groups


def dgpo_loss(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
              beta: float, loss_type: str = "sigmoid") -> tuple[torch.Tensor, dict]:
    """DGPO, the group-level preference loss: the mean over groups of the Diffusion-DPO pair loss
    (:data:`posttrain.objectives.dpo_loss.PAIR_LOSSES`) of inside = -s_g (:func:`dgpo_group_margin`), i.e. a group's
    better-than-mean samples (A > 0) against its worse ones (A < 0), weighted by |A|. ``sigmoid``:
    -log sigmoid(-s_g), ln 2 when policy = reference. The reference code trains a surrogate with the same
    gradient up to the constant G / (beta B); this is the loss itself. Returns (float32 scalar, stats:
    ``implicit_acc`` share of groups with s_g < 0, ``reward_margin`` mean -s_g)."""
    from posttrain.objectives.dpo_loss import PAIR_LOSSES

    margin, _ = dgpo_group_margin(err, ref_err, advantages, group_ids, beta)
    inside = -margin
    loss = PAIR_LOSSES[loss_type](inside).mean()
    with torch.no_grad():
        hits = (inside > 0).float() + 0.5 * (inside == 0).float()
        stats = {"implicit_acc": float(hits.mean()), "reward_margin": float(inside.mean())}
    return loss, stats
