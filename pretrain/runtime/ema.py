"""Exponential moving average of the trainable weights, sharded like them.

The EMA is a :class:`pretrain.runtime.shadow.ShadowWeights`: one copy of each trainable parameter's
local data (this rank's shard under FSDP2 / TP), written and resharded by DCP like the parameters (the
checkpoint holds DTensors). Frozen parameters (a LoRA base) never change, so they need no copy.
Sampling and export use the EMA by swapping it into the model's parameters (:meth:`EMA.swapped`; the
trained weights come back on exit), so the sharded model samples and exports through its usual
collectives.

The update is ``torch.optim.swa_utils.AveragedModel``'s with ``get_ema_multi_avg_fn``: the first
update copies the weights, every later one is ``ema <- decay * ema + (1 - decay) * param``
(``torch._foreach_lerp_``); its state keys are ``AveragedModel``'s (``module.<name>``, ``n_averaged``),
so a checkpoint written with an ``AveragedModel`` EMA resumes.
"""

from __future__ import annotations

import torch

from pretrain.runtime.shadow import ShadowWeights, local_data


class EMA(ShadowWeights):
    """The EMA of ``model``'s trainable parameters, ``decay`` in (0, 1), kept as this rank's shards
    (:class:`ShadowWeights`). ``state_dict()`` gives DTensors for sharded parameters (DCP reshards
    them) and plain tensors otherwise."""

    def __init__(self, model: torch.nn.Module, decay: float):
        super().__init__(model)
        self.decay = decay
        self.n_averaged = torch.zeros((), dtype=torch.long)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step after an optimizer step: a copy the first time, then the lerp towards the weights."""
        names = list(self.params)
        shadow, current = [self.shadow[n] for n in names], [local_data(self.params[n]) for n in names]
        if int(self.n_averaged) == 0:
            torch._foreach_copy_(shadow, current)
        else:
            torch._foreach_lerp_(shadow, current, 1.0 - self.decay)
        self.n_averaged += 1

    def state_dict(self) -> dict:
        """``{"module.<name>": EMA weight (a DTensor when the parameter is one), "n_averaged": count}``."""
        state = {f"module.{n}": self.as_param(n) for n in self.shadow}
        state["n_averaged"] = self.n_averaged
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` gave (the values DCP read into its tensors)."""
        self.load_tensors({n: state[f"module.{n}"] for n in self.shadow})
        self.n_averaged = torch.as_tensor(state["n_averaged"], dtype=torch.long).clone()


def build_ema(model: torch.nn.Module, decay: float) -> EMA | None:
    """The EMA of ``model`` (:class:`EMA`), or None when ``decay`` is 0. Raises ``ValueError`` unless
    0 <= decay < 1."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"train.ema_decay must be in [0, 1), got {decay}")
    return None if decay == 0.0 else EMA(model, decay)
