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


def guided_velocity(model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                    guidance_scale: float, detach_uncond: bool = True, uncond_model=None,
                    uncond_in_batch: bool = False) -> torch.Tensor:
    """v = v_uncond + w (v_cond - v_uncond) (Ho & Salimans 2022), float32 ``[B, ...]``.

    ``model(x, sigma [B], embeds) -> v``. With ``guidance_scale == 1`` only the conditional branch
    runs. When gradients are enabled and ``detach_uncond`` is set (this project's default), the
    unconditional branch carries no gradient, so the gradient is w * dv_cond. It then runs separately
    under ``no_grad`` on ``uncond_model`` (default ``model``; any module computing the same function,
    e.g. the policy with LoRA merged into its weights), unless ``uncond_in_batch``: one 2B forward with
    a graph whose unconditional half is detached afterwards (flow_grpo's training step: the same
    gradient, a backward over both halves). Without ``detach_uncond`` both branches run as one 2B batch
    with gradients through both (w * dv_cond - (w - 1) * dv_uncond). The forward value is the same in
    every mode up to float rounding."""
    b = x.shape[0]
    sigma = sigma.expand(b) if sigma.ndim == 0 or sigma.shape[0] != b else sigma
    if guidance_scale == 1.0:
        return model(x, sigma, embeds)
    null = expand_null(null_embeds, b)
    if torch.is_grad_enabled() and detach_uncond and not uncond_in_batch:
        v_cond = model(x, sigma, embeds)
        with torch.no_grad():
            v_uncond = (uncond_model or model)(x, sigma, null)
    else:
        both = PromptEmbeds.cat([embeds, null])
        v_cond, v_uncond = model(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        if detach_uncond:
            v_uncond = v_uncond.detach()
    return cfg_combine(v_cond, v_uncond, guidance_scale)
