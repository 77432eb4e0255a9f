"""The UNet family's adapter: a ``UNet2DConditionModel`` predicting epsilon (or v / x0) under a DDPM-type
schedule behind the flow-matching backbone interface.

The state is the flow state y = x_t / (alpha_t + s_t) at sigma = s_t / (alpha_t + s_t); the adapter
feeds the UNet x_t = y / sqrt((1 - sigma)^2 + sigma^2) at the scheduler timestep of sigma and returns
v = eps_hat - x0_hat. The derivation, and why our Euler ODE sampler then walks exactly the pipeline's
DDIM (eta 0) or Euler discrete steps, is in :mod:`pretrain.models.unet.vp_schedule`. Used by the
pipeline folders (:mod:`pretrain.models.unet.pipeline`) and the pixel-space presets
(:mod:`pretrain.models.unet.model`).
"""

from __future__ import annotations

import json

import torch

from pretrain.backbone import Backbone
from pretrain.models.unet.vp_schedule import VPSchedule, flow_velocity, vp_state
from pretrain.text_encoder import PromptEmbeds

UNET_ATTENTION = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]


def scheduler_from_config(config: dict):
    """A diffusers scheduler from its config dict (``_class_name`` picks the class, e.g. a
    ``scheduler_config.json``'s content). Raises ``ValueError`` for a missing or unknown class name."""
    import diffusers

    name = config.get("_class_name")
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "from_config"):
        raise ValueError(f"scheduler: '_class_name' {name!r} is not a diffusers scheduler class")
    return cls.from_config(config)


class UNetAdapter(Backbone):
    """``forward(x [B, C, h, w] flow state, sigma [B] in [0, 1], embeds) -> velocity float32``
    around a ``UNet2DConditionModel`` (``self.transformer``, the interface's name). ``schedule``: the
    scheduler's :class:`VPSchedule`; ``time_ids``: SDXL's ``[1, 6]`` added time ids, None otherwise.
    Blocks (FSDP2 units): ``down_blocks``, ``mid_block``, ``up_blocks``; no sequence-parallel plan."""

    lora_targets = UNET_ATTENTION
    block_attrs = ("down_blocks", "mid_block", "up_blocks")

    def __init__(self, unet: torch.nn.Module, schedule: VPSchedule, time_ids: torch.Tensor | None = None):
        super().__init__(unet)
        self.schedule, self.time_ids = schedule, time_ids

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The scheduler's sigmas in flow coordinates, float32 ``[n + 1]`` ending at 0. ``shift`` must be
        None (or 1): the scheduler owns the schedule; ``ValueError`` otherwise."""
        if shift not in (None, 1, 1.0):
            raise ValueError(f"the UNet family samples its scheduler's timesteps; shift must be null, got {shift}")
        return self.schedule.sigmas(num_inference_steps)

    def train_sigmas(self) -> torch.Tensor:
        """The flow sigma of each of the scheduler's training timesteps, float32 ``[T]``
        (:meth:`VPSchedule.train_sigmas`)."""
        return self.schedule.train_sigmas()

    def initial_scale(self, sigma0: float) -> float:
        """y0 = noise * scale reproduces the pipeline's ``latents * init_noise_sigma`` (see
        :meth:`VPSchedule.initial_scale`)."""
        return self.schedule.initial_scale(sigma0)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The scheduler timestep of the VP state at flow ``sigma`` (:meth:`VPSchedule.timestep`)."""
        return self.schedule.timestep(sigma.to(torch.float32)).float()

    def export_settings(self) -> dict:
        """``{"scheduler": the scheduler's config dict with its _class_name}`` (plus ``"time_ids"`` as a
        list when set): what :meth:`from_settings` rebuilds this adapter from."""
        out = {"scheduler": json.loads(self.schedule.scheduler.to_json_string())}
        if self.time_ids is not None:
            out["time_ids"] = self.time_ids.flatten().tolist()
        return out

    @classmethod
    def from_settings(cls, transformer: torch.nn.Module, settings: dict) -> "UNetAdapter":
        """The adapter around ``transformer`` with the scheduler of ``settings["scheduler"]`` (a config
        dict, :func:`scheduler_from_config`) and optional ``settings["time_ids"]`` (6 numbers). Raises
        ``ValueError`` naming the key for a missing scheduler, an unknown key, or a scheduler
        :class:`VPSchedule` does not support."""
        unknown = sorted(set(settings) - {"scheduler", "time_ids"})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown adapter setting(s) {unknown} (known: scheduler, time_ids)")
        if "scheduler" not in settings:
            raise ValueError(f"{cls.__name__}: adapter setting 'scheduler' (the noise scheduler config) is required")
        time_ids = settings.get("time_ids")
        time_ids = None if time_ids is None else torch.tensor([time_ids], dtype=torch.float32)
        return cls(transformer, VPSchedule(scheduler_from_config(settings["scheduler"])), time_ids)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        sigma = sigma.to(x.device, torch.float32).expand(x.shape[0])
        added = None
        if self.time_ids is not None:
            added = {"text_embeds": embeds.pooled.to(x.device, dtype),
                     "time_ids": self.time_ids.to(x.device, dtype).expand(x.shape[0], -1)}
        pred = self.transformer(vp_state(x.float(), sigma).to(dtype), self.schedule.timestep(sigma),
                                encoder_hidden_states=embeds.tokens.to(x.device, dtype), added_cond_kwargs=added,
                                return_dict=False)[0]
        return flow_velocity(pred, x, sigma, self.schedule.prediction_type)
