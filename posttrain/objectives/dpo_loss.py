"""Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908, eq. 14) in its reference code's form.

Each error is the per-sample mean over elements of the squared prediction error (velocity for
flow-matching models, noise for epsilon-prediction models). With winner w and loser l sharing noise,
timestep and prompt embedding:

    inside = -0.5 * beta * [(e_w - e_w,ref) - (e_l - e_l,ref)]

``sigmoid`` (DPO): -log sigmoid(inside); ``hinge`` (SLiC, Zhao et al. 2023): max(0, 1 - inside);
``ipo`` (Azar et al. 2023, eq. 17: (h - 1/(2 tau))^2 with h = inside / beta and tau = beta, scaled by
beta^2): (inside - 1/2)^2. A pair with preference probability p (1: w preferred, 0.5: a tie) costs
p * loss(inside) + (1 - p) * loss(-inside), so a tie pulls neither image ahead; losses are averaged
over pairs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

PAIR_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": lambda inside: -F.logsigmoid(inside),
    "hinge": lambda inside: torch.relu(1 - inside),
    "ipo": lambda inside: (inside - 0.5).square(),
}


def winner_preserving_scale(res_w: torch.Tensor, res_l: torch.Tensor, mu: float, max_scale: float = 1.0,
                            eps: float = 1e-12) -> torch.Tensor:
    """Diffusion-SDPO's loser-gradient scale (Fu et al. 2025, arXiv 2511.03317, the winner-preserving
    condition): with g_w, g_l the gradients of the winners' and the losers' mean squared errors with
    respect to the predictions (proportional to the residuals ``res_w``, ``res_l``, float ``[P, ...]``,
    prediction minus target, in the error space, paired row by row), a first-order step along
    -g_w + lambda g_l keeps the winners' error falling by at least mu ||g_w||^2 when
    lambda <= (1 - mu) ||g_w||^2 / <g_l, g_w>. Returns that bound, clamped to [0, ``max_scale``], when
    <g_l, g_w> > 0, else ``max_scale`` (float32 scalar, detached). ``mu`` in [0, 1]."""
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"dpo.sdpo_mu: must be in [0, 1], got {mu}")
    rw, rl = res_w.detach().double().flatten(), res_l.detach().double().flatten()
    num, den = rw.square().sum(), (rl * rw).sum()
    lam = (1.0 - mu) * num / (den + eps) if den > 0 else torch.tensor(max_scale, dtype=torch.float64)
    return lam.clamp(0.0, max_scale).float()


def scale_gradient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` in value, ``scale * d x`` in gradient: x.detach() + scale * (x - x.detach())."""
    return x.detach() + scale * (x - x.detach())


def dpo_inside_term(err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """float32 ``[P]``: -0.5 * beta * ((e_w - e_w,ref) - (e_l - e_l,ref)); all inputs ``[P]``."""
    return -0.5 * beta * ((err_w.float() - ref_err_w.float()) - (err_l.float() - ref_err_l.float()))


def diffusion_dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor,
                       beta: float, loss_type: str = "sigmoid", *, pref: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict]:
    """Mean pair loss (float32 scalar) and detached stats: implicit accuracy over non-tie pairs (share
    with inside > 0; inside == 0 counts 0.5; 0.5 when every pair is a tie), implicit reward margin
    (mean inside term), and the mean model-minus-reference error difference for winners and losers.
    ``pref``: float ``[P]`` probability that the w image is preferred (default 1). ``ValueError`` for
    an unknown ``loss_type``."""
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"dpo.loss_type: unknown '{loss_type}' (known: {sorted(PAIR_LOSSES)})")
    inside = dpo_inside_term(err_w, err_l, ref_err_w, ref_err_l, beta)
    fn = PAIR_LOSSES[loss_type]
    p = torch.ones_like(inside) if pref is None else pref.float()
    loss = (p * fn(inside) + (1 - p) * fn(-inside)).mean()
    with torch.no_grad():
        strict = p != 0.5
        hits = (inside > 0).float() + 0.5 * (inside == 0).float()
        acc = hits[strict].mean() if strict.any() else torch.tensor(0.5)
        stats = {"implicit_acc": float(acc), "reward_margin": float(inside.mean()),
                 "err_diff_w": float((err_w - ref_err_w).mean()), "err_diff_l": float((err_l - ref_err_l).mean())}
    return loss, stats
