"""The backbone interface every model adapter implements (the project's own presets and each real
model family in :mod:`pretrain.families`).

An adapter is a ``torch.nn.Module`` whose ``forward(x, sigma, embeds)`` returns the flow-matching
velocity v = eps - x0 for the state x = (1 - sigma) x0 + sigma eps (float32, shape of ``x``), whatever
the wrapped model predicts (velocity, epsilon) and however it lays out its input (packed patches,
video latents). Everything downstream (ODE/SDE sampling, log-probs, GRPO, DPO) only sees this
interface, so a model family is one adapter file, never a copy of a trainer.
"""

from __future__ import annotations

import copy

import torch

from pretrain.schedule import sigma_schedule


class Backbone(torch.nn.Module):
    """Base class of model adapters.

    ``transformer``: the diffusers denoiser (a transformer, or a UNet for the UNet family): LoRA,
    FSDP2, compile and exports act on it. Subclasses implement ``forward(x [B, ...], sigma [B] float
    in [0, 1], embeds: PromptEmbeds) -> velocity float32 [B, ...]`` and may override the hooks below.
    """

    #: LoRA target module names (peft ``target_modules``) used when the policy config names none.
    lora_targets: list[str] = []

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The sampling schedule, float32 ``[num_inference_steps + 1]``, decreasing, last entry 0.
        Default: :func:`pretrain.schedule.sigma_schedule` with ``shift`` (None = 1). A family
        adapter returns its pipeline scheduler's sigmas, so our sampler walks the pipeline's steps."""
        return sigma_schedule(num_inference_steps, 1.0 if shift is None else shift)

    def initial_scale(self, sigma0: float) -> float:
        """Factor turning unit Gaussian noise into the state at the schedule's first sigma
        ``sigma0``. 1 for flow models (they start from pure noise, sigma0 = 1)."""
        return 1.0

    def with_transformer(self, transformer: torch.nn.Module) -> "Backbone":
        """A shallow copy of this adapter (same settings) around another denoiser, e.g. a LoRA-merged
        copy of its own. The module's own registries (submodules, parameters, hooks) are copied, not
        shared, so nothing registered on one reaches the other."""
        new = copy.copy(self)
        for k, v in self.__dict__.items():
            if k.startswith("_") and isinstance(v, dict):
                new.__dict__[k] = type(v)(v)
        new._modules["transformer"] = transformer
        return new


#: Attributes holding a denoiser's repeated blocks, in forward order: SD3 / FLUX (``transformer_blocks``,
#: FLUX's ``single_transformer_blocks``), Wan (``blocks``), UNets (``down_blocks``, ``mid_block``,
#: ``up_blocks``).
BLOCK_ATTRS = ("transformer_blocks", "single_transformer_blocks", "blocks", "down_blocks", "mid_block", "up_blocks")


def denoiser_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a diffusers denoiser (the units of FSDP2 sharding, activation checkpointing
    and per-block compile), in forward order. ``ValueError`` naming the class if it has none."""
    out: list[torch.nn.Module] = []
    for name in BLOCK_ATTRS:
        found = getattr(transformer, name, None)
        if isinstance(found, torch.nn.ModuleList):
            out += list(found)
        elif isinstance(found, torch.nn.Module):
            out.append(found)
    if not out:
        raise ValueError(f"{type(transformer).__name__}: no blocks found (looked for {BLOCK_ATTRS})")
    return out
