"""The "old" policy of the forward-process methods: a copy of the policy that trails it by an EMA.

DiffusionNFT samples its rollouts with it and mixes its velocity into the implicit positive and
negative policies; AWM keeps one as a second KL anchor. After each iteration's update,
old <- decay * old + (1 - decay) * policy over the trainable weights, with
decay = 0 before ``start`` iterations, then min((iterations - start) * rate, max) (the schedule of
NVlabs/DiffusionNFT's ``return_decay``; its defaults: start 0, rate 0.001, max 0.5).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class OldDecay:
    """EMA decay schedule of the old copy, in iterations (see the module docstring)."""

    start: int = 0
    rate: float = 0.001
    max: float = 0.5

    def validate(self, prefix: str = "") -> None:
        if self.start < 0 or self.rate < 0 or not 0.0 <= self.max < 1.0:
            raise ValueError(f"{prefix.rstrip('.')}: start and rate must be >= 0 and max in [0, 1), got {self}")

    def __call__(self, iterations: int) -> float:
        return 0.0 if iterations < self.start else min((iterations - self.start) * self.rate, self.max)


class OldPolicy:
    """A frozen deep copy of ``policy.model`` (LoRA adapters included) whose trainable weights follow the
    policy's by :class:`OldDecay`. Checkpointed (``state_dict``) with the run, so a resume continues
    with the same old weights."""

    def __init__(self, model: torch.nn.Module, decay: OldDecay):
        self.decay = decay
        self.model = copy.deepcopy(model).requires_grad_(False).eval()
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        own = dict(self.model.named_parameters())
        self.params = [own[n] for n in self.names]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, iterations: int) -> float:
        """old <- d old + (1 - d) policy for the trainable weights of ``model``, d = decay(``iterations``
        completed); returns d."""
        d = self.decay(iterations)
        live = dict(model.named_parameters())
        for name, old in zip(self.names, self.params):
            old.lerp_(live[name].detach().to(old.dtype), 1.0 - d)
        return d

    def state_dict(self) -> dict:
        return {n: p.detach() for n, p in zip(self.names, self.params)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for n, p in zip(self.names, self.params):
            p.copy_(state[n])
