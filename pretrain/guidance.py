"""Classifier-free guidance: the guided velocity that ODE sampling, SDE rollout and GRPO training all
call, and the empty-prompt substitution used for condition dropout."""

from __future__ import annotations

import torch

from pretrain.flow import cfg_combine
from pretrain.text_encoder import PromptEmbeds


def expand_null(null_embeds: PromptEmbeds, b: int) -> PromptEmbeds:
    """The empty-prompt embedding ``[1, ...]`` repeated to ``[b, ...]``."""
    return PromptEmbeds(null_embeds.tokens.expand(b, -1, -1), null_embeds.pooled.expand(b, -1))


def drop_condition(embeds: PromptEmbeds, null_embeds: PromptEmbeds, drop: torch.Tensor) -> PromptEmbeds:
    """``embeds`` ``[B, ...]`` with the rows where ``drop`` (bool ``[B]``) is set replaced by the
    empty-prompt embedding ``null_embeds`` ``[1, ...]`` (condition dropout for CFG training)."""
    null = expand_null(null_embeds, embeds.tokens.shape[0])
    return PromptEmbeds(torch.where(drop[:, None, None], null.tokens, embeds.tokens),
                        torch.where(drop[:, None], null.pooled, embeds.pooled))


def guided_branches(model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                    detach_uncond: bool = True, uncond_model=None, uncond_in_batch: bool = False,
                    v_uncond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two CFG branches ``(v_cond, v_uncond)``, float32 ``[B, ...]`` each; ``sigma`` ``[B]``.

    When gradients are enabled and ``detach_uncond`` is set (this project's default), the unconditional
    branch carries no gradient. It then runs separately under ``no_grad`` on ``uncond_model`` (default
    ``model``; any module computing the same function, e.g. the policy with LoRA merged into its
    weights), unless ``uncond_in_batch``: one 2B forward with a graph whose unconditional half is
    detached afterwards (flow_grpo's training step: the same gradient, a backward over both halves).
    Without ``detach_uncond`` both branches run as one 2B batch with gradients through both.
    ``v_uncond``: the unconditional velocity already computed at these inputs by the same weights
    (a rollout's, before any optimizer step); it is used instead of a forward. ``ValueError`` when
    given without ``detach_uncond`` (a recorded value carries no gradient)."""
    if v_uncond is not None:
        if not detach_uncond:
            raise ValueError("guided_branches: a precomputed v_uncond needs detach_uncond (it has no gradient)")
        return model(x, sigma, embeds), v_uncond.detach()
    null = expand_null(null_embeds, x.shape[0])
    if torch.is_grad_enabled() and detach_uncond and not uncond_in_batch:
        v_cond = model(x, sigma, embeds)
        with torch.no_grad():
            v_uncond = (uncond_model or model)(x, sigma, null)
        return v_cond, v_uncond
    both = PromptEmbeds.cat([embeds, null])
    v_cond, v_uncond = model(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
    return v_cond, v_uncond.detach() if detach_uncond else v_uncond


def guided_velocity(model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                    guidance_scale: float, detach_uncond: bool = True, uncond_model=None,
                    uncond_in_batch: bool = False, v_uncond: torch.Tensor | None = None) -> torch.Tensor:
    """v = v_uncond + w (v_cond - v_uncond) (Ho & Salimans 2022), float32 ``[B, ...]``.

    ``model(x, sigma [B], embeds) -> v``; ``sigma`` a scalar or ``[B]``. With ``guidance_scale == 1``
    only the conditional branch runs. The other arguments choose how the branches are computed
    (:func:`guided_branches`): with ``detach_uncond`` the gradient is w * dv_cond, without it
    w * dv_cond - (w - 1) * dv_uncond. The forward value is the same in every mode up to float rounding."""
    b = x.shape[0]
    sigma = sigma.expand(b) if sigma.ndim == 0 or sigma.shape[0] != b else sigma
    if guidance_scale == 1.0:
        return model(x, sigma, embeds)
    branches = guided_branches(model, x, sigma, embeds, null_embeds, detach_uncond, uncond_model, uncond_in_batch,
                               v_uncond)
    return cfg_combine(*branches, guidance_scale)
