"""The ``shards`` data source: a train split read lazily from tar or parquet shards
(:mod:`pretrain.data.shards`) and a small held-out split decoded up front.

The split is by a hash of each sample's key (``data.heldout_fraction``), so it does not move when shards
are added or reordered. The train split is a :class:`ShardSet`: samples are decoded when a batch asks
for them (in DataLoader workers, :mod:`pretrain.data.feed`), captions encoded per batch. The held-out split
keeps its first ``data.heldout_max`` usable samples in memory for the held-out loss and the grids.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pretrain.data.emoji import is_heldout
from pretrain.data.folder import DatasetError
from pretrain.data.shards import VIDEO_EXTS, BadSample, ClipSampling, ParquetColumns, ShardIndex, ShardReader, \
    build_index, decode_image, decode_video, list_shards

log = logging.getLogger(__name__)


class ShardSet:
    """The samples ``ids`` (positions in ``index``) of a shard set at ``height`` x ``width``.

    ``get(j)`` -> (uint8 ``[3, H, W]`` tensor, or ``[F, 3, H, W]`` for a video clip sampled by ``clip``,
    caption, (shard, key)) of the j-th sample, or raises
    :class:`pretrain.data.shards.BadSample`; ``stream_counts()``: samples per shard (the stream order's input);
    ``encode(captions)``: their embeddings (the run's text encoder). ``lazy = True`` marks a set the
    feed reads through DataLoader workers."""

    lazy = True

    def __init__(self, index: ShardIndex, ids: np.ndarray, size: tuple[int, int], encoder,
                 columns: ParquetColumns, max_pixels: int, buckets: list[tuple[int, int]] | None = None,
                 clip: ClipSampling | None = None):
        self.index, self.ids, self.size, self.encoder = index, ids, size, encoder
        self.reader, self.max_pixels = ShardReader(index, columns), max_pixels
        self.clip = clip or ClipSampling(max_pixels=max_pixels)
        self.buckets = [tuple(b) for b in buckets] if buckets else None
        self.bucket_of = nearest_bucket(np.asarray(index.size)[ids], self.buckets) if self.buckets else None

    def shape_of(self, j: int) -> tuple[int, int]:
        """(height, width) sample ``j`` is decoded at: its bucket's, else ``size``."""
        return self.buckets[int(self.bucket_of[j])] if self.buckets else self.size

    def bucket_counts(self) -> dict[str, int]:
        """Train samples per bucket, ``{"HxW": n}``."""
        counts = np.bincount(self.bucket_of, minlength=len(self.buckets)) if self.buckets else [len(self)]
        shapes = self.buckets or [self.size]
        return {f"{h}x{w}": int(n) for (h, w), n in zip(shapes, counts)}

    def __len__(self) -> int:
        return len(self.ids)

    def __getstate__(self):  # DataLoader workers need no text encoder
        return {**self.__dict__, "encoder": None}

    def stream_counts(self) -> list[int]:
        shard = np.asarray(self.index.shard, dtype=np.int64)[self.ids]
        return np.bincount(shard, minlength=len(self.index.shards)).tolist()

    def where(self, j: int) -> tuple[str, str]:
        return self.reader.where(int(self.ids[j]))

    def get(self, j: int) -> tuple[torch.Tensor, str, tuple[str, str]]:
        i = int(self.ids[j])
        data, caption, ext = self.reader.read(i)
        where = self.reader.where(i)
        height, width = self.shape_of(j)
        if ext in VIDEO_EXTS:  # [F, 3, H, W]
            video = decode_video(data, ext, self.clip, height, width, where)
            return torch.from_numpy(video.copy()).permute(0, 3, 1, 2).contiguous(), caption, where
        image = decode_image(data, height, width, self.max_pixels, where)
        return torch.from_numpy(image.copy()).permute(2, 0, 1).contiguous(), caption, where

    def encode(self, captions: list[str]):
        return self.encoder.encode(captions)


def nearest_bucket(sizes: np.ndarray, buckets: list[tuple[int, int]]) -> np.ndarray:
    """Per image (``sizes``: ``[n, 2]`` width, height; ``[0, 0]`` when unknown, taken as square) the index
    of the bucket (height, width) nearest its aspect ratio in log space (ties: the first bucket)."""
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    known = (sizes > 0).all(axis=1)
    aspect = np.where(known, np.log(np.where(known, sizes[:, 1], 1) / np.where(known, sizes[:, 0], 1)), 0.0)
    targets = np.log(np.array([h / w for h, w in buckets]))
    return np.abs(aspect[:, None] - targets[None, :]).argmin(axis=1)


def shard_sets(cfg, encoder, cache: Path) -> tuple[ShardSet, torch.Tensor, list[str]]:
    """(train :class:`ShardSet`, held-out uint8 images ``[m, 3, H, W]``, their captions) for
    ``data.source: shards`` (``cfg``: the ``DataConfig``; ``cache``: the folder of the shard index).
    ``DatasetError`` naming ``data.path`` when a split is empty or no held-out sample decodes."""
    columns = ParquetColumns(cfg.image_column, cfg.caption_column, cfg.key_column)
    index = build_index(list_shards(cfg.path), cache, columns)
    held = np.array([is_heldout(k, cfg.heldout_fraction) for k in index.key], dtype=bool)
    train_ids, held_ids = np.flatnonzero(~held), np.flatnonzero(held)
    if cfg.limit:
        train_ids, held_ids = train_ids[:cfg.limit], held_ids[:max(1, cfg.limit // 8)]
    if not len(train_ids) or not len(held_ids):
        raise DatasetError(f"data.path: the {'train' if not len(train_ids) else 'held-out'} split of '{cfg.path}' "
                           f"is empty ({len(index)} samples, heldout_fraction={cfg.heldout_fraction})")
    size = (cfg.size, cfg.size)
    clip = ClipSampling(cfg.frames, cfg.frame_stride, cfg.fps, cfg.max_pixels)
    train = ShardSet(index, train_ids, size, encoder, columns, cfg.max_pixels, cfg.buckets or None, clip)
    pool = ShardSet(index, held_ids, size, encoder, columns, cfg.max_pixels, clip=clip)
    images, captions, bad = [], [], []
    for j in range(len(pool)):
        if len(images) == cfg.heldout_max:
            break
        try:
            image, caption, _ = pool.get(j)
        except BadSample as e:
            bad.append(str(e))
            continue
        images.append(image)
        captions.append(caption)
    if bad:
        log.warning("shards: held-out split skipped %d bad sample(s), first: %s", len(bad), "; ".join(bad[:5]))
    if not images:
        raise DatasetError(f"data.path: no held-out sample of '{cfg.path}' decodes ({len(bad)} bad)")
    log.info("shards: %d train samples in %d shard(s), %d held-out kept in memory%s", len(train),
             len(index.shards), len(images), f"; buckets {train.bucket_counts()}" if train.buckets else "")
    return train, torch.stack(images), captions
