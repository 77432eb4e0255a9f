"""The resumable batch sampler the stages draw rows with: a seeded permutation per epoch, its state
(epoch, offset) checkpointed with the run."""

from __future__ import annotations

import numpy as np
import torch

from pretrain.data.folder import DatasetError
from pretrain.seeding import generator_for


class EpochSampler:
    """Resumable shuffled batches: epoch ``e`` is a permutation drawn from (seed, "data", e) (a list, or
    an int64 array in the streaming subclasses); batches run across epoch boundaries. State is (epoch,
    offset)."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise DatasetError("cannot sample from an empty dataset")
        self.n, self.seed, self.epoch, self.offset = n, seed, 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return torch.randperm(self.n, generator=generator_for(self.seed, "data", epoch)).tolist()

    def next(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` row indices in [0, n), continuing into the next epoch's permutation
        when this one runs out (so a batch that spans two epochs may hold a row twice)."""
        out: list[int] = []
        while len(out) < batch_size:
            take = min(batch_size - len(out), len(self._perm) - self.offset)
            chunk = self._perm[self.offset:self.offset + take]
            out += chunk.tolist() if isinstance(chunk, np.ndarray) else chunk
            self.offset += take
            if self.offset == len(self._perm):
                self.epoch, self.offset = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return out

    def state_dict(self) -> dict:
        """``{"epoch", "offset"}``: where the next batch starts (the permutation is redrawn from the seed)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`: the same epoch's permutation, from the same offset."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._perm = self._permutation(self.epoch)
