"""Gradient accumulation: micro-batches -> loss scaling -> backward -> one optimizer step.

Every stage's training loop (pretraining and midtraining, Diffusion-DPO, the GRPO update engines)
runs its micro-batches through one :class:`Accumulation`: each backward piece goes through
:meth:`pretrain.runtime.runtime.Runtime.backward` (which divides the loss by ``train.grad_accum`` and
applies the fp16 loss scaler), the logged loss of the step is the sum of the pieces' values each
divided by ``grad_accum`` (the mean over the step's micro-batches), and after every ``grad_accum``-th
micro-batch :meth:`pretrain.runtime.runtime.Runtime.optimizer_step` runs once.
"""

from __future__ import annotations

from typing import Callable

import torch


class Accumulation:
    """The micro-batches of one optimizer step after another, over ``runtime`` (a
    :class:`pretrain.runtime.runtime.Runtime`; ``runtime.cfg.grad_accum`` micro-batches per step).

    A micro-batch is one or more :meth:`backward` calls (e.g. transition chunks, forward-process
    draws) closed by :meth:`end_micro_batch`, which after the ``grad_accum``-th returns the step's
    metrics. The count runs on across calls (e.g. over inner epochs)."""

    def __init__(self, runtime):
        self.rt, self.accum = runtime, runtime.cfg.grad_accum
        self.micro, self.loss, self.stats = 0, 0.0, {}

    def backward(self, loss: torch.Tensor, value: float | None = None, stats: dict[str, float] | None = None
                 ) -> float:
        """Backward of ``loss`` (a float32 scalar, weighted as the caller wants it in the gradient);
        adds ``value`` (default ``loss.item()``; the caller's weighting of the logged loss) divided by
        ``grad_accum`` to the step's loss, and each of ``stats`` divided by ``grad_accum`` to the
        step's stats. Returns ``value``."""
        self.rt.backward(loss)
        value = loss.item() if value is None else value
        self.loss += value / self.accum
        for key, v in (stats or {}).items():
            self.stats[key] = self.stats.get(key, 0.0) + v / self.accum
        return value

    def end_micro_batch(self, buckets: dict[str, tuple[float, int]] | None = None,
                        reduce: Callable[[list[float]], list[float]] | None = None) -> dict:
        """Close one micro-batch. After the ``grad_accum``-th: ``reduce`` (e.g. the mean over
        data-parallel ranks, on [loss, *stats sorted by name]) when given, then one optimizer step
        (``buckets``: the spike detector's, see :meth:`pretrain.runtime.runtime.Runtime.optimizer_step`);
        returns ``{"loss": step loss, **stats, **optimizer metrics}`` and starts the next step.
        Before that: ``{}``."""
        self.micro += 1
        if self.micro % self.accum:
            return {}
        loss, stats = self.loss, self.stats
        if reduce is not None:
            keys = sorted(stats)
            loss, *values = reduce([loss, *(stats[k] for k in keys)])
            stats = dict(zip(keys, values))
        self.loss, self.stats = 0.0, {}
        metrics = self.rt.optimizer_step(loss) if buckets is None else self.rt.optimizer_step(loss, buckets)
        return {"loss": loss, **stats, **metrics}
