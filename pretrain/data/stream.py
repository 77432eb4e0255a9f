"""The global sample order of a sharded set: shard order, then a bounded shuffle buffer, keyed by
(seed, epoch) and computed from the shard index alone, so it is the same for every world size and
every number of loader workers, and a resumed run recomputes it from (epoch, offset).

This is the order WebDataset's ``shuffle(buffer)`` after a shard shuffle produces, made deterministic:
reads stay local to about ``buffer`` samples of a few consecutive shards, while the order a step sees
is not the file order.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from pretrain.data.sampler import EpochSampler
from pretrain.seeding import seed_for

log = logging.getLogger(__name__)


def stream_order(counts: list[int], seed: int, epoch: int, buffer: int) -> np.ndarray:
    """Sample positions (int64 ``[sum(counts)]``, a permutation) for ``epoch``: the shards (sample
    counts ``counts``, positions laid out shard after shard) in an order drawn from (seed, "shuffle",
    epoch), their samples passed through a shuffle buffer of ``buffer`` slots (each incoming sample
    replaces a uniformly drawn slot, whose sample is emitted; the last ``buffer`` drain in a random
    order). ``buffer`` <= 1 keeps the file order within shards."""
    rng = np.random.default_rng(seed_for(seed, "shuffle", epoch))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    ids = np.concatenate([np.arange(starts[s], starts[s] + counts[s]) for s in rng.permutation(len(counts))]
                         or [np.zeros(0, np.int64)])
    if buffer <= 1 or len(ids) <= 1:
        return ids
    out = np.empty_like(ids)
    slots = ids[:buffer].copy()
    draws = rng.integers(0, len(slots), size=max(0, len(ids) - len(slots)))
    for n, incoming in enumerate(ids[len(slots):]):
        j = draws[n]
        out[n] = slots[j]
        slots[j] = incoming
    out[len(ids) - len(slots):] = rng.permutation(slots)
    return out


class StreamSampler(EpochSampler):
    """:class:`pretrain.data.sampler.EpochSampler` whose epoch order is :func:`stream_order` over shards
    of ``counts`` samples: same state (epoch, offset), same cross-epoch batches."""

    def __init__(self, counts: list[int], seed: int, buffer: int):
        self.counts, self.buffer = list(counts), buffer
        super().__init__(int(sum(counts)), seed)

    def _permutation(self, epoch: int) -> np.ndarray:
        return stream_order(self.counts, self.seed, epoch, self.buffer)

    def digest(self) -> str:
        """What the stream depends on besides (seed, epoch): the samples per shard and the buffer (and,
        for buckets, each sample's bucket and the batch size), hashed."""
        h = hashlib.sha256(np.asarray(self.counts, dtype=np.int64).tobytes())
        h.update(str(self.buffer).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stream": self.digest()}

    def load_state_dict(self, state: dict) -> None:
        """Restore (epoch, offset); ``ValueError`` when the checkpoint's stream differs (shards added or
        removed, ``data.shuffle_buffer``, ``data.buckets`` or ``train.batch_size`` changed): the samples
        after the resume would not be the ones the run would have seen."""
        saved = state.get("stream")
        if saved is not None and saved != self.digest():
            raise ValueError("data: the checkpoint's sample stream differs from this run's (the shards, "
                             "data.shuffle_buffer, data.buckets or train.batch_size changed since it was written); "
                             "resume with the same data, or start a new run")
        super().load_state_dict(state)


def sampler_for(data, seed: int, buffer: int, batch_size: int) -> EpochSampler:
    """The run's sampler over ``data`` (global micro-batches of ``batch_size``): a :class:`BucketSampler`
    for a set with aspect-ratio buckets (``data.bucket_of``), a :class:`StreamSampler` for a set laid
    out in shards (``data.stream_counts()`` gives its samples per shard), else an
    :class:`pretrain.data.sampler.EpochSampler` (a permutation per epoch)."""
    counts = data.stream_counts() if hasattr(data, "stream_counts") else None
    if counts is None:
        return EpochSampler(len(data), seed)
    if getattr(data, "bucket_of", None) is not None:
        return BucketSampler(counts, data.bucket_of, seed, buffer, batch_size)
    return StreamSampler(counts, seed, buffer)


class BucketSampler(StreamSampler):
    """Aspect-ratio buckets over a :func:`stream_order`: walking the epoch's order, each sample joins its
    bucket's pending list (``bucket_of``: bucket per position), and a bucket that reaches ``batch_size``
    emits a global micro-batch, so every micro-batch is of one bucket and the batches interleave in
    stream order. A bucket's last partial batch of an epoch is dropped (``dropped``: per epoch, the count);
    the epoch's length is a multiple of ``batch_size`` and varies by epoch. ``next`` must be called with
    ``batch_size``. State (epoch, offset) as the base class."""

    def __init__(self, counts: list[int], bucket_of: np.ndarray, seed: int, buffer: int, batch_size: int):
        self.batch_size, self.bucket_of, self.dropped = batch_size, np.asarray(bucket_of), {}
        super().__init__(counts, seed, buffer)

    def digest(self) -> str:
        h = hashlib.sha256((super().digest() + str(self.batch_size)).encode())
        h.update(np.asarray(self.bucket_of, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def _permutation(self, epoch: int) -> np.ndarray:
        pending: dict[int, list[int]] = {}
        out: list[int] = []
        for i in stream_order(self.counts, self.seed, epoch, self.buffer).tolist():
            group = pending.setdefault(int(self.bucket_of[i]), [])
            group.append(i)
            if len(group) == self.batch_size:
                out += group
                group.clear()
        self.dropped[epoch] = sum(len(g) for g in pending.values())
        if not out:
            raise ValueError(f"data.buckets: no bucket holds a full batch of {self.batch_size} samples")
        log.info("data: epoch %d in buckets: %d batches of %d, %d samples left over (each bucket's last partial "
                 "batch)", epoch, len(out) // self.batch_size, self.batch_size, self.dropped[epoch])
        return np.asarray(out, dtype=np.int64)

    def next(self, batch_size: int) -> list[int]:
        if batch_size != self.batch_size:
            raise ValueError(f"BucketSampler: batches of {self.batch_size}, asked for {batch_size}")
        return super().next(batch_size)
