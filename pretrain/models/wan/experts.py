"""Wan2.2 A14B's two experts as one denoiser (Wan team 2025, arXiv 2503.20314; the Wan2.2 release).

``WanPipeline`` with ``transformer_2`` and ``boundary_ratio`` denoises with ``transformer`` (the
high-noise expert) while the step's timestep t >= ``boundary_ratio * num_train_timesteps`` and with
``transformer_2`` (the low-noise expert) below it. :class:`WanExperts` holds both and routes each row of
a batch the same way, by the timestep it is given, so everything that acts on "the transformer" (LoRA,
its reference with adapters disabled, the merged inference copy, FSDP2 blocks, the export) acts on both:
each expert carries its own adapter, and the export writes both components (:meth:`WanExperts.components`).
"""

from __future__ import annotations

import copy
import torch


class WanExperts(torch.nn.Module):
    """``high`` (the pipeline's ``transformer``) for rows whose timestep is >= ``boundary_timestep``,
    ``low`` (``transformer_2``) for the others; forward as ``WanTransformer3DModel``'s
    (``hidden_states [B, C, F', h, w]``, ``timestep`` float32 ``[B]`` or per token ``[B, L]`` with one
    value per row, ``encoder_hidden_states [B, L_text, D]``) returning a 1-tuple of the velocity."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_timestep: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self):
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    def expert_of(self, timestep: torch.Tensor) -> torch.Tensor:
        """long ``[B]``: 0 (``high``) where the row's timestep is >= the boundary, else 1 (``low``): the
        comparison ``WanPipeline`` makes on its float32 timesteps."""
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        return (t < self.boundary_timestep).long()

    def components(self) -> dict[str, torch.nn.Module]:
        """The pipeline components, by their folder names: ``transformer`` and ``transformer_2``."""
        return {"transformer": self.high, "transformer_2": self.low}

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs) -> tuple[torch.Tensor]:
        which = self.expert_of(timestep)
        experts = (self.high, self.low)
        used = which.unique().tolist()
        if len(used) == 1:  # a rollout batch: every row at one step
            return (experts[used[0]](hidden_states=hidden_states, timestep=timestep,
                                     encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)[0],)
        out = None
        for e in used:
            rows = (which == e).nonzero().squeeze(1)
            y = experts[e](hidden_states=hidden_states[rows], timestep=timestep[rows],
                           encoder_hidden_states=encoder_hidden_states[rows], return_dict=False, **kwargs)[0]
            out = y.new_zeros((hidden_states.shape[0], *y.shape[1:])) if out is None else out
            out = out.index_copy(0, rows, y)
        return (out,)

    # ---- what the policy, its merged copy and the export call on a diffusers denoiser, for both experts
    def add_adapter(self, config, adapter_name: str = "default") -> None:
        self.high.add_adapter(config, adapter_name)
        self.low.add_adapter(copy.deepcopy(config), adapter_name)

    @property
    def peft_config(self) -> dict:
        return self.high.peft_config

    def disable_adapters(self) -> None:
        self.high.disable_adapters(), self.low.disable_adapters()

    def enable_adapters(self) -> None:
        self.high.enable_adapters(), self.low.enable_adapters()

    def fuse_lora(self, *args, **kwargs) -> None:
        self.high.fuse_lora(*args, **kwargs), self.low.fuse_lora(*args, **kwargs)

    def unload_lora(self) -> None:
        self.high.unload_lora(), self.low.unload_lora()
