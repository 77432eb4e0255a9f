"""A term an update engine adds to every mini-batch's loss (the pre-training loss,
:mod:`posttrain.base.data_loss`), shared by the transition and forward-process update engines."""

from __future__ import annotations

from typing import Callable

import torch

#: A term added to each mini-batch's loss by an update engine: called with the mini-batch's number in the
#: iteration (0, 1, ... over the inner epochs), it returns (float32 scalar, already weighted; stats).
ExtraLoss = Callable[[int], tuple[torch.Tensor, dict]]


def add_extra(acc, extra: ExtraLoss | None, number: int, stats: dict) -> None:
    """Backward of ``extra(number)`` through ``acc`` (an :class:`Accumulation`) into the mini-batch's
    gradient; its stats go into ``stats``. Nothing when ``extra`` is None."""
    if extra is not None:
        value, extra_stats = extra(number)
        acc.backward(value)
        stats.update(extra_stats)
