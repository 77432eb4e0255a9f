"""This rank's micro-batches, read ahead by DataLoader workers, with the time the step waited for them.

Every rank draws the same global micro-batch indices from the run's sampler (its state is the
checkpoint's data position) and reads its contiguous share. For a lazy set (sharded data,
:mod:`pretrain.data.sharded_set`; latent caches, :mod:`pretrain.data.latent_cache`) a
``torch.utils.data.DataLoader`` decodes the shares ahead in ``workers`` processes (``prefetch`` batches
each, pinned memory on CUDA; a CPU text encoder embeds the captions in the workers too); its batch
sampler walks a copy of the sampler, and each batch it returns
is checked against the run's own sampler, which advances only when a batch is consumed, so a
checkpoint never counts a batch that was read ahead but not trained. In-memory sets are indexed
directly.

A sample that cannot be read is skipped, never replaced: the micro-batch trains the rest, and
:class:`Fed` names what was skipped (shard, key, reason) for the run to count and log.
"""

from __future__ import annotations

import copy
import multiprocessing
import time
from dataclasses import dataclass, field

import torch

from pretrain.data.shards import BadSample


@dataclass
class Fed:
    """One micro-batch share. ``images``: float32 ``[n, 3, H, W]`` in [0, 1] (None when the set
    holds latents); ``latents``: the codec's latents ``[n, ...]`` from a cache, or None; ``embeds``:
    PromptEmbeds ``[n, ...]``; ``positions``: each kept sample's position in the global micro-batch
    (keys the per-sample noise); ``keys``: "shard:key" per kept sample of a sharded set, else its
    index; ``skipped``: ``(shard, key, reason)`` per skipped sample; ``wait_s``: seconds the caller
    waited for this batch; ``shape``: (height, width) of a lazy set's batch (its bucket); ``nominal``: the
    share's size before any skip."""

    images: torch.Tensor | None
    latents: torch.Tensor | None
    embeds: object
    captions: list[str]
    positions: list[int]
    keys: list[str]
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    wait_s: float = 0.0
    shape: tuple[int, int] | None = None
    nominal: int = 0


class _Samples(torch.utils.data.Dataset):
    """Map-style view of a lazy set for the DataLoader: item ``(position, index)`` -> a decoded sample
    or the reason it was skipped."""

    def __init__(self, data):
        self.data = data

    def __getitem__(self, item):
        position, j = item
        try:
            return ("ok", position, j, *self.data.get(j))
        except BadSample as e:
            return ("bad", position, j, (e.shard, e.key, e.reason))

    def __len__(self) -> int:
        return len(self.data)


class _Collate:
    """Stacks a batch's decoded samples (one tensor per field, so a worker passes a few shared-memory
    blocks, not one per sample); with ``encode``, embeds the captions in the worker too."""

    def __init__(self, encode=None):
        self.encode = encode

    def __call__(self, rows: list) -> dict:
        good = [r for r in rows if r[0] == "ok"]
        out = {"positions": [r[1] for r in good], "ids": [r[2] for r in rows], "captions": [r[4] for r in good],
               "keys": [f"{r[5][0]}:{r[5][1]}" for r in good], "skipped": [r[3] for r in rows if r[0] == "bad"]}
        out["tensors"] = torch.stack([r[3] for r in good]) if good else None
        out["extra"] = tuple(torch.stack(parts) for parts in zip(*[r[6] for r in good])) \
            if good and len(good[0]) > 6 else None
        out["embeds"] = self.encode(out["captions"]) if self.encode and good else None
        return out


class _Ahead:
    """The batch sampler: this rank's share of each coming global micro-batch, from a copy of the
    sampler, as ``(position, index)`` pairs."""

    def __init__(self, sampler, batch_size: int, share: tuple[int, int]):
        self.sampler, self.batch_size, (self.lo, self.hi) = copy.deepcopy(sampler), batch_size, share

    def __iter__(self):
        while True:
            idx = self.sampler.next(self.batch_size)
            yield [(p, idx[p]) for p in range(self.lo, self.hi)]


class BatchFeed:
    """Micro-batch shares of ``data`` in the order of ``sampler`` (global micro-batches of
    ``batch_size``, this rank's ``share`` = (lo, hi)). ``workers``: DataLoader processes for a lazy set
    (0 reads in this process); ``prefetch``: batches read ahead per worker; ``pin``: pinned memory."""

    def __init__(self, data, sampler, batch_size: int, share: tuple[int, int], *, workers: int = 0,
                 prefetch: int = 2, pin: bool = False):
        self.data, self.sampler, self.batch_size, self.share = data, sampler, batch_size, share
        self.workers, self.prefetch, self.pin = workers, prefetch, pin
        self._it = None

    def _iterator(self):
        fork = "fork" in multiprocessing.get_all_start_methods()
        loader = torch.utils.data.DataLoader(
            _Samples(self.data), batch_sampler=_Ahead(self.sampler, self.batch_size, self.share),
            collate_fn=_Collate(self._worker_encoder(fork)), num_workers=self.workers, pin_memory=self.pin,
            prefetch_factor=self.prefetch if self.workers else None, persistent_workers=False,
            multiprocessing_context="fork" if self.workers and fork else None)
        return iter(loader)

    def _worker_encoder(self, fork: bool):
        """The set's caption encoder when workers may run it: forked workers (the encoder is shared, not
        pickled), an on-the-fly set (not a cache) and an encoder on the CPU (a CUDA model is not forked)."""
        if not (self.workers and fork) or getattr(self.data, "latents", False) or not hasattr(self.data, "encode"):
            return None
        encoder = getattr(self.data, "encoder", None)
        return self.data.encode if encoder is not None and str(getattr(encoder, "device", "cpu")) == "cpu" else None

    def close(self) -> None:
        """Stop the workers now (a new iterator starts at the next batch)."""
        if self._it is not None and hasattr(self._it, "_shutdown_workers"):
            self._it._shutdown_workers()
        self._it = None

    def next(self) -> Fed:
        """The next micro-batch share; advances the sampler by one global micro-batch."""
        t0 = time.perf_counter()
        lo, hi = self.share
        if not getattr(self.data, "lazy", False):
            idx = self.sampler.next(self.batch_size)
            images, embeds, captions = self.data.batch(idx[lo:hi])
            return Fed(images, None, embeds, captions, list(range(lo, hi)), [str(i) for i in idx[lo:hi]],
                       wait_s=time.perf_counter() - t0, nominal=hi - lo)
        if self._it is None:  # started at the first batch: after a resume has set the sampler's state
            self._it = self._iterator()
        idx = self.sampler.next(self.batch_size)
        got = next(self._it)
        if got["ids"] != idx[lo:hi]:
            raise RuntimeError(f"data feed out of step with the sampler: read {got['ids'][:4]}..., "
                               f"expected {idx[lo:hi][:4]}...")
        fed = self._fed(got)
        fed.wait_s = time.perf_counter() - t0
        fed.shape = self.data.shape_of(idx[lo]) if hasattr(self.data, "shape_of") else self.data.size
        fed.nominal = hi - lo
        return fed

    def _fed(self, got: dict) -> Fed:
        captions, tensors = got["captions"], got["tensors"]
        cached = getattr(self.data, "latents", False)
        if tensors is None:
            images = latents = embeds = None
        elif cached:
            images, latents, embeds = None, tensors, self.data.embeds(got["extra"])
        else:
            embeds = got["embeds"] if got["embeds"] is not None else self.data.encode(captions)
            images, latents = tensors.float() / 255.0, None
        return Fed(images, latents, embeds, captions, got["positions"], got["keys"], got["skipped"])
