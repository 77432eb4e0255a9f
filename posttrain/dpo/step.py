"""One Diffusion-DPO step: the pairs' denoising errors under the policy and the reference, the pair
loss, the held-out implicit accuracy, and the optimizer step over ``train.grad_accum`` micro-batches
(Wallace et al. 2023, arXiv 2311.12908, eq. 14; the loss is :mod:`posttrain.objectives.dpo_loss`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain.base.policy import Policy
from posttrain.base.stage import StageRanks
from posttrain.dpo.data import PairSet
from posttrain.dpo.errors import flow_residuals
from posttrain.objectives.dpo_loss import diffusion_dpo_loss, dpo_inside_term, scale_gradient, winner_preserving_scale
from pretrain.data.sampler import EpochSampler
from pretrain.guidance import drop_condition
from pretrain.objective import draw_training_noise, objective_sigmas
from pretrain.runtime.accumulate import Accumulation
from pretrain.runtime.runtime import Runtime
from pretrain.text_encoder import PromptEmbeds

if TYPE_CHECKING:
    from posttrain.dpo.stage import DPOConfig, DPOLossConfig


def pair_errors(model, codec, pairs: PairSet, cfg: DPOLossConfig, null: PromptEmbeds, *, seed: int, step: int,
                offset: int, device, stream: str = "train", reference=None, residuals: bool = False):
    """Per-pair errors (e_w, e_l) ``[P]`` of ``model`` (and of ``reference`` when given). Pair i's
    (noise, sigma, prompt dropout) is keyed by (seed, stream, step, offset + i) and shared by its
    winner and loser; with ``error_space: noise`` errors are scaled by (1 - sigma)^2. ``residuals``: each
    tuple also holds the residuals (r_w, r_l) ``[P, ...]`` in the error space (e = mean(r^2))."""
    p = len(pairs)
    x0 = codec.encode(torch.cat([pairs.images_w, pairs.images_l]).to(device))
    table = objective_sigmas(model, cfg.flow, "dpo.flow.objective")
    noise, sigma, drop = draw_training_noise(x0[:p], seed, step, range(offset, offset + p), cfg.flow, stream=stream,
                                             train_sigmas=table)
    noise, sigma, drop = torch.cat([noise, noise]), torch.cat([sigma, sigma]), torch.cat([drop, drop])
    embeds = drop_condition(PromptEmbeds.cat([pairs.embeds, pairs.embeds]).to(device), null, drop)
    scale = (1 - sigma) ** 2 if cfg.error_space == "noise" else torch.ones_like(sigma)
    out = []
    for m in (model, reference):
        if m is None:
            continue
        res = flow_residuals(m, x0, embeds, noise, sigma)
        err = res.square().flatten(1).mean(1) * scale
        if residuals:
            res = res * scale.sqrt().view(-1, *[1] * (res.dim() - 1))
            out.append((err[:p], err[p:], res[:p], res[p:]))
        else:
            out.append((err[:p], err[p:]))
    return out


def pair_loss(policy: Policy, codec, pairs: PairSet, cfg: DPOLossConfig, null: PromptEmbeds, *, seed: int, step: int,
              offset: int, device):
    """DPO loss of one micro-batch of pairs (see :func:`pair_errors`). Returns (float32 loss, stats)."""
    draw = dict(seed=seed, step=step, offset=offset, device=device)
    safeguard = cfg.sdpo_mu is not None
    ew, el, *res = pair_errors(policy.model, codec, pairs, cfg, null, residuals=safeguard, **draw)[0]
    with torch.no_grad(), policy.reference() as ref:
        (rw, rl), = pair_errors(ref, codec, pairs, cfg, null, **draw)
    if safeguard:  # Diffusion-SDPO: the losers' gradient scaled so the winners' error does not rise
        lam = winner_preserving_scale(*res, cfg.sdpo_mu)
        el = scale_gradient(el, lam)
    loss, stats = diffusion_dpo_loss(ew, el, rw, rl, cfg.beta, cfg.loss_type, pref=pairs.pref.to(device))
    if safeguard:
        stats["sdpo_scale"] = float(lam)
    return loss, stats


@torch.no_grad()
def implicit_accuracy(policy: Policy, codec, pairs: PairSet, cfg: DPOLossConfig, null: PromptEmbeds, *, seed: int,
                      device, batch: int = 64) -> float:
    """Share of non-tie ``pairs`` whose inside term is > 0 (== 0 counts 0.5), with a fixed (noise,
    sigma) per pair (stream "eval"), so the number is comparable across steps."""
    hits, count = 0.0, 0
    for s in range(0, len(pairs), batch):
        sub = pairs.select(list(range(s, min(len(pairs), s + batch))))
        draw = dict(seed=seed, step=0, offset=s, device=device, stream="eval")
        (ew, el), = pair_errors(policy.model, codec, sub, cfg, null, **draw)
        with policy.reference() as ref:
            (rw, rl), = pair_errors(ref, codec, sub, cfg, null, **draw)
        inside = dpo_inside_term(ew, el, rw, rl, cfg.beta)
        strict = sub.pref.to(device) != 0.5
        hits += float(((inside > 0).float() + 0.5 * (inside == 0).float())[strict].sum())
        count += int(strict.sum())
    return hits / count if count else 0.5


def dpo_step(policy: Policy, rt: Runtime, codec, pairs: PairSet, sampler: EpochSampler, *, cfg: DPOConfig,
             null: PromptEmbeds, step: int, device, ranks: StageRanks | None = None) -> dict:
    """One optimizer step over ``train.grad_accum`` global micro-batches of ``train.batch_size`` pairs;
    every rank draws the same pair indices and trains its ``ranks.share``. ``loss`` and the pair stats
    are averaged over the data-parallel ranks (the global mean: equal shares)."""
    b, accum = cfg.train.batch_size, cfg.train.grad_accum
    lo, hi = ranks.share(b) if ranks else (0, b)
    policy.model.train()
    acc, metrics = Accumulation(rt), {}
    for micro in range(accum):
        with rt.autocast():
            loss, stats = pair_loss(policy, codec, pairs.select(sampler.next(b)[lo:hi]), cfg.dpo, null,
                                    seed=cfg.train.seed, step=step, offset=micro * b + lo, device=device)
        acc.backward(loss, stats=stats)
        # every rank's guard must see the same loss: the mean over ranks
        metrics = acc.end_micro_batch(reduce=ranks.mean if ranks else None)
    return metrics
