"""Asynchronous reward scoring: batches are scored in a thread pool while the caller goes on (the next
rollout batch samples meanwhile); results are reassembled in submission order, so the score of sample
i is always reward i whatever order the work finishes in."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class AsyncScorer:
    """Wraps a composite reward ``reward(images, prompts, metadata) -> (total [B], {name: raw [B]})``.

    ``workers`` = 0 scores synchronously inside :meth:`submit`. :meth:`gather` returns the concatenated
    (total float32 ``[N]``, ``{name: float32 [N]}``) of every batch submitted since the last gather, in
    submission order, and records the seconds it waited in ``wait_seconds``. Exceptions raised by the
    reward surface in :meth:`gather`."""

    def __init__(self, reward, workers: int = 1):
        self.reward = reward
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward") if workers > 0 else None
        self.pending: list[Future | tuple] = []
        self.wait_seconds = 0.0

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> None:
        images = images.detach()
        if self.pool is None:
            self.pending.append(self.reward(images, prompts, metadata))
        else:
            self.pending.append(self.pool.submit(self.reward, images, prompts, metadata))

    def gather(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        parts = [p.result() if isinstance(p, Future) else p for p in self.pending]
        self.wait_seconds = time.perf_counter() - t0
        self.pending = []
        if not parts:
            raise ValueError("AsyncScorer.gather: nothing was submitted")
        total = torch.cat([t for t, _ in parts])
        raw = {name: torch.cat([r[name] for _, r in parts]) for name in parts[0][1]}
        return total, raw

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
