"""Exponential moving average of weights (torch.optim.swa_utils.AveragedModel)."""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def build_ema(model: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An EMA copy of ``model`` (ema = decay * ema + (1 - decay) * param) or None when decay is 0.
    Raises ``ValueError`` unless 0 <= decay < 1."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"train.ema_decay must be in [0, 1), got {decay}")
    if decay == 0.0:
        return None
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)
    ema.requires_grad_(False)
    return ema
