"""Classifier-free guidance: the guided velocity of ODE sampling and of the rollout, and the empty-prompt
substitution used for condition dropout. How a training update computes the branches (detached,
merged copy, reused from the rollout) is the update's business (:mod:`rollout.branches`)."""

from __future__ import annotations

import torch

from pretrain.flow import cfg_combine
from pretrain.text_encoder import PromptEmbeds


def drop_condition(embeds: PromptEmbeds, null_embeds: PromptEmbeds, drop: torch.Tensor) -> PromptEmbeds:
    """``embeds`` ``[B, ...]`` with the rows where ``drop`` (bool ``[B]``) is set replaced by the
    empty-prompt embedding ``null_embeds`` ``[1, ...]`` (condition dropout for CFG training); the
    conditioning images, if any, are kept (the unconditional branch keeps them too)."""
    null = embeds.unconditional(null_embeds)
    return PromptEmbeds(torch.where(drop[:, None, None], null.tokens, embeds.tokens),
                        torch.where(drop[:, None], null.pooled, embeds.pooled), embeds.images, embeds.negative)


def cfg_branches(model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 null_embeds: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
    """The two CFG branches ``(v_cond, v_uncond)``, float32 ``[B, ...]`` each, from one forward of 2B
    rows (conditional rows first); ``sigma`` ``[B]``, ``null_embeds`` ``[1, ...]`` (the negative or
    empty prompt; the unconditional rows keep ``embeds``' conditioning images). Gradients, if enabled,
    flow through both halves."""
    cond = PromptEmbeds(embeds.tokens, embeds.pooled, embeds.images)  # the forward reads no negative rows
    both = PromptEmbeds.cat([cond, embeds.unconditional(null_embeds)])
    v_cond, v_uncond = model(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
    return v_cond, v_uncond


def combine(model, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """The guided velocity of ``model``'s family, float32 like ``v_cond``: its ``cfg_combine`` (a
    :class:`pretrain.backbone.Backbone` method; Qwen-Image rescales each token to the conditional
    branch's norm), else :func:`pretrain.flow.cfg_combine` (a bare module)."""
    rule = getattr(model, "cfg_combine", None)
    return (rule or cfg_combine)(v_cond, v_uncond, guidance_scale)


def uses_cfg(model, guidance_scale: float) -> bool:
    """Whether sampling ``model`` at ``guidance_scale`` runs the unconditional branch: a scale other than 1,
    or a family that guides another stream at its own scale even then (``model.guides_at_unit_scale``: LTX-2's
    audio, as ``LTX2Pipeline`` guides it when only ``audio_guidance_scale`` exceeds 1)."""
    return guidance_scale != 1.0 or bool(getattr(model, "guides_at_unit_scale", False))


def guided_velocity(model, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, null_embeds: PromptEmbeds,
                    guidance_scale: float) -> torch.Tensor:
    """v = v_uncond + w (v_cond - v_uncond) (Ho & Salimans 2022, eq. 6 in velocity form; the family's
    rule, :func:`combine`), float32 ``[B, ...]``, the branches from :func:`cfg_branches`.

    ``model(x, sigma [B], embeds) -> v``; ``sigma`` a scalar or ``[B]``. Without CFG (:func:`uses_cfg`: a
    ``guidance_scale`` of 1) only the conditional branch runs."""
    b = x.shape[0]
    sigma = sigma.expand(b) if sigma.ndim == 0 or sigma.shape[0] != b else sigma
    if not uses_cfg(model, guidance_scale):
        return model(x, sigma, embeds)
    return combine(model, *cfg_branches(model, x, sigma, embeds, null_embeds), guidance_scale)
