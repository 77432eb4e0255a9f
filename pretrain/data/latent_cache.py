"""Latent + text-embedding caches: a dataset encoded once by the family's codec and text encoder, read
by training instead of the images (``data.source: latent_cache``), so a step runs neither encoder.

A cache folder holds ``latents-000000.safetensors``, ... (tensors ``latents`` float32 ``[n, C, h, w]``,
``tokens`` ``[n, L, D]`` and ``pooled`` ``[n, D]``; metadata: the rows' keys and captions), a
``heldout.safetensors`` (the held-out split as uint8 images ``[m, 3, H, W]`` with their ``tokens`` and
``pooled``, for the held-out loss and grids, which decode and encode as the uncached path does), and
``cache.json``: the codec's and the text encoder's identity (:attr:`pretrain.codec.PatchifyCodec.identity`,
the encoder's ``cache_key``), the image size, the source, and the rows per shard. A run whose codec or
text encoder differs is refused, naming both (:func:`check_identity`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pretrain.data.folder import DatasetError
from pretrain.text_encoder import PromptEmbeds

MANIFEST = "cache.json"
FORMAT = 1


def write_shard(path: Path, latents: torch.Tensor, embeds: PromptEmbeds, keys: list[str], captions: list[str],
                images: torch.Tensor | None = None) -> None:
    """One cache shard, written atomically: ``latents`` (or ``images`` uint8 for the held-out shard),
    ``embeds``' tokens and pooled, and the rows' keys and captions."""
    tensors = {"tokens": embeds.tokens.float().contiguous(), "pooled": embeds.pooled.float().contiguous()}
    tensors |= {"latents": latents.float().contiguous()} if images is None else {"images": images.contiguous()}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"keys": json.dumps(keys), "captions": json.dumps(captions)})
    os.replace(tmp, path)


def read_manifest(folder: str | Path) -> dict:
    """``cache.json`` of ``folder``; ``DatasetError`` naming the file when it is missing or unreadable."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a latent cache ({type(e).__name__}: {e}); write one with `posttrain "
                           f"cache CONFIG`") from e
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"{path}: cache format {manifest.get('format')}, this version reads {FORMAT}")
    return manifest


def check_identity(manifest: dict, folder, *, codec: str | None = None, text_encoder: str | None = None) -> None:
    """``DatasetError`` naming the cache's and the run's codec (or text encoder) when they differ."""
    for what, ours in (("codec", codec), ("text_encoder", text_encoder)):
        if ours is not None and manifest[what] != ours:
            raise DatasetError(f"data.path: the latent cache '{folder}' was made by {what} '{manifest[what]}', "
                               f"this run's {what} is '{ours}'; re-run `posttrain cache` with this run's {what}")


class LatentCacheSet:
    """The train rows of a latent cache, read lazily (``lazy = True``; ``latents = True``: the feed
    gives latents and cached embeddings). ``get(j)`` -> (latents ``[C, h, w]``, caption, (shard, key),
    (tokens, pooled)); ``stream_counts()``: the source's samples per shard (the stream order);
    ``embeds((tokens, pooled))``: a batch's stacked embeddings;
    ``size``: the images' (H, W) in pixels."""

    lazy = latents = True

    def __init__(self, folder: str | Path, manifest: dict):
        self.folder, self.manifest = Path(folder), manifest
        self.shards = [self.folder / s["file"] for s in manifest["shards"]]
        self._counts = [int(s["rows"]) for s in manifest["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(self._counts)]).astype(np.int64)
        self.size = (int(manifest["size"][0]), int(manifest["size"][1]))
        self.identity = manifest["codec"]
        self._open: dict[int, object] = {}
        self._keys: dict[int, list[str]] = {}
        self._captions: dict[int, list[str]] = {}

    def __getstate__(self):
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def stream_counts(self) -> list[int] | None:
        """The source's samples per shard as cached (its stream order), None for an in-memory source
        (a permutation per epoch)."""
        return self.manifest.get("stream_counts")

    def _file(self, shard: int):
        f = self._open.get(shard)
        if f is None:
            f = self._open[shard] = safe_open(self.shards[shard], "pt")
            meta = f.metadata()
            self._keys[shard], self._captions[shard] = json.loads(meta["keys"]), json.loads(meta["captions"])
        return f

    def get(self, j: int):
        shard = int(np.searchsorted(self._starts, j, side="right") - 1)
        row = j - int(self._starts[shard])
        f = self._file(shard)
        latents = f.get_slice("latents")[row:row + 1][0]
        embeds = (f.get_slice("tokens")[row:row + 1][0], f.get_slice("pooled")[row:row + 1][0])
        return latents, self._captions[shard][row], (self.shards[shard].name, self._keys[shard][row]), embeds

    def embeds(self, stacked: tuple[torch.Tensor, torch.Tensor]) -> PromptEmbeds:
        """PromptEmbeds of a batch's stacked (tokens, pooled)."""
        return PromptEmbeds(*stacked)


def cache_sets(cfg, encoder) -> tuple[LatentCacheSet, torch.Tensor, list[str], PromptEmbeds]:
    """(train :class:`LatentCacheSet`, held-out uint8 images, captions and embeddings) for ``data.source:
    latent_cache`` (``cfg.path``: the cache folder). Refuses a cache made by another text encoder than
    ``encoder`` (the codec is checked by the trainer, which builds it) or at another ``data.size``."""
    manifest = read_manifest(cfg.path)
    check_identity(manifest, cfg.path, text_encoder=getattr(encoder, "cache_key", None))
    if tuple(manifest["size"]) != (cfg.size, cfg.size):
        raise DatasetError(f"data.size: {cfg.size}, but the latent cache '{cfg.path}' holds {manifest['size']} images")
    train = LatentCacheSet(cfg.path, manifest)
    with safe_open(Path(cfg.path) / "heldout.safetensors", "pt") as f:
        images, tokens, pooled = f.get_tensor("images"), f.get_tensor("tokens"), f.get_tensor("pooled")
        captions = json.loads(f.metadata()["captions"])
    if cfg.limit and cfg.limit < len(train):
        raise DatasetError(f"data.limit: {cfg.limit} on a latent cache of {len(train)} rows; cache with the "
                           f"limit instead (the cache keeps its source's order)")
    return train, images, captions, PromptEmbeds(tokens, pooled)


def require_codec(data, codec) -> None:
    """For a :class:`LatentCacheSet`, ``DatasetError`` naming both codecs unless ``codec`` made it; a no-op
    for any other set."""
    if getattr(data, "latents", False):
        check_identity(data.manifest, data.folder, codec=codec.identity)
