"""How the two classifier-free-guidance branches are computed when a transition's log-prob is
recomputed for training. The guidance equation itself (:func:`pretrain.guidance.combine`) and the
step only see the velocities; this object decides where they come from, which changes speed and
float rounding, never the value."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.guidance import cfg_branches
from pretrain.text_encoder import PromptEmbeds


@dataclass
class CFGBranches:
    """``(v_cond, v_uncond)`` of ``model`` at given rows, float32 ``[N, ...]`` each.

    - ``detach_uncond`` (Flow-GRPO's training step keeps both branches in the graph; this project
      detaches the unconditional one by default): with gradients enabled, the unconditional branch
      runs separately under ``no_grad`` on ``uncond_model`` (default ``model``; any module computing
      the same function, e.g. the policy with LoRA merged into its weights), unless
      ``uncond_in_batch``: one 2N forward with a graph whose unconditional half is detached afterwards
      (flow_grpo's layout: the same gradient, a backward over both halves). Without ``detach_uncond``
      both branches run as one 2N batch with gradients through both. Without gradients, one 2N forward.
    - ``reuse_recorded``: take the unconditional branch from the velocities the rollout recorded at
      these rows (valid only while the weights are the rollout's, i.e. before the first optimizer
      step; needs ``detach_uncond``: a recorded value carries no gradient).

    Called as ``branches(x, sigma [N], embeds, null [1, ...] or None, recorded)`` with ``recorded`` a
    zero-argument function returning the recorded unconditional velocities ``[N, ...]`` at those rows
    (gathered only when used), or None when the trajectory holds none;
    ``null`` None (guidance scale 1) runs the conditional branch only and returns ``(v_cond, None)``.
    Raises ``ValueError`` when ``reuse_recorded`` is set without ``detach_uncond``."""

    model: torch.nn.Module
    detach_uncond: bool = True
    uncond_model: torch.nn.Module | None = None
    uncond_in_batch: bool = False
    reuse_recorded: bool = False

    def __post_init__(self):
        if self.reuse_recorded and not self.detach_uncond:
            raise ValueError("CFGBranches: reuse_recorded needs detach_uncond (a recorded velocity has no gradient)")

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, null: PromptEmbeds | None,
                 recorded=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.model
        if null is None:
            return model(x, sigma, embeds), None
        if self.reuse_recorded and recorded is not None:
            return model(x, sigma, embeds), recorded().detach()
        if torch.is_grad_enabled() and self.detach_uncond and not self.uncond_in_batch:
            v_cond = model(x, sigma, embeds)
            with torch.no_grad():
                v_uncond = (self.uncond_model or model)(x, sigma, embeds.unconditional(null))
            return v_cond, v_uncond
        v_cond, v_uncond = cfg_branches(model, x, sigma, embeds, null)
        return v_cond, v_uncond.detach() if self.detach_uncond else v_uncond
