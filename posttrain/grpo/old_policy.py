"""The "old" policy of the forward-process methods: a copy of the policy's trainable weights that trails
them by an EMA.

DiffusionNFT samples its rollouts with it and mixes its velocity into the implicit positive and
negative policies; AWM keeps one as a second KL anchor. After each iteration's update,
old <- decay * old + (1 - decay) * policy over the trainable weights, with
decay = 0 before ``start`` iterations, then min((iterations - start) * rate, max) (the schedule of
NVlabs/DiffusionNFT's ``return_decay``; its defaults: start 0, rate 0.001, max 0.5).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pretrain.runtime.shadow import ShadowWeights, local_data


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


class OldPolicy(ShadowWeights):
    """The old policy: a copy of ``model``'s trainable weights (:class:`pretrain.runtime.shadow.ShadowWeights`:
    with LoRA, the adapter's size, not a model copy; under FSDP2 this rank's shards) that follows the
    policy's by :class:`OldDecay`. It runs as the policy's model with the copy swapped in
    (:meth:`swapped`: the frozen base is shared). Checkpointed (``state_dict``: DTensors under FSDP2,
    so DCP reshards them on another world size) with the run, so a resume continues with the same old weights."""

    def __init__(self, model: torch.nn.Module, decay: OldDecay):
        super().__init__(model)
        self.decay = decay

    @torch.no_grad()
    def update(self, iterations: int) -> float:
        """old <- d old + (1 - d) policy for the trainable weights, d = decay(``iterations`` completed);
        returns d."""
        d = self.decay(iterations)
        for name, old in self.shadow.items():
            old.lerp_(local_data(self.params[name]).to(old.dtype), 1.0 - d)
        return d

    @contextmanager
    def running(self, model: torch.nn.Module):
        """``with old.running(model) as m:`` ``model`` (the policy's) with the old weights, in eval mode
        and without gradient; the policy's weights and mode come back on exit."""
        was_training = model.training
        with self.swapped(), torch.no_grad():
            try:
                yield model.eval()
            finally:
                model.train(was_training)

    sharded_state = True  # checkpointed as DTensors under FSDP2: a resume on another world size reshards it

    def state_dict(self) -> dict:
        return {n: self.as_param(n) for n in self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.load_tensors(state)
