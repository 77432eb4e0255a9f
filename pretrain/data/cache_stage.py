"""`posttrain cache`: encode a dataset once into a latent cache (:mod:`pretrain.data.latent_cache`) with the
family's codec and text encoder; training reads it with ``data.source: latent_cache``.

A data stage: in a pipeline, ``data_from: cache`` points the next stage at ``<run_dir>/cache/data`` (so
curate -> cache -> midtrain is one pipeline), and the model passes through untouched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pretrain.codec import CodecConfig, build_codec
from pretrain.config import require_positive, save_config
from pretrain.data.dataset import DataConfig, build_datasets, refuse_conditions
from pretrain.data.latent_cache import FORMAT, MANIFEST, write_shard
from pretrain.data.shards import BadSample
from pretrain.text_encoder import PromptEmbeds, TextEncoderConfig, text_encoder_from_config

log = logging.getLogger(__name__)


@dataclass
class CacheModel:
    """``pretrained``: an export passed through (what the pipeline's next stage continues from)."""

    pretrained: str | None = None


@dataclass
class CacheConfig:
    """``data``: the source to encode (any image or video source; a ``shards`` set is read lazily, bad
    samples skipped and counted); ``text_encoder`` and ``codec``: the run's (their identities are recorded and
    checked when training reads the cache); ``batch_size``: samples per encoder call; ``per_shard``: rows
    per cache shard; ``device``: where the encoders run. Output: ``<run_dir>/cache/data``."""

    run_dir: str = "runs/cache"
    model: CacheModel = field(default_factory=CacheModel)
    data: DataConfig = field(default_factory=DataConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    batch_size: int = 64
    per_shard: int = 4096
    device: str = "cpu"

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "batch_size", "per_shard")
        if self.data.source in ("prompts", "latent_cache"):
            raise ValueError(f"{prefix}data.source: cache encodes images or videos; '{self.data.source}' holds none")
        if self.data.buckets:
            raise ValueError(f"{prefix}data.buckets: a cache holds one latent shape; cache without buckets")


def _train_batches(train, batch_size: int):
    """(uint8 images, captions, keys, skipped) batches of the train split, in index order; ``skipped``:
    (row, "shard:key (reason)") of the bad samples of a sharded set."""
    n = len(train)
    for start in range(0, n, batch_size):
        rows = range(start, min(n, start + batch_size))
        if not getattr(train, "lazy", False):
            images, _, captions = train.batch(list(rows))
            yield (images * 255).round().to(torch.uint8), captions, [f"row:{i}" for i in rows], []
            continue
        images, captions, keys, skipped = [], [], [], []
        for j in rows:
            try:
                image, caption, (shard, key) = train.get(j)
            except BadSample as e:
                skipped.append((j, f"{e.shard}:{e.key} ({e.reason})"))
                continue
            images.append(image)
            captions.append(caption)
            keys.append(f"{shard}:{key}")
        yield (torch.stack(images) if images else None), captions, keys, skipped


def cache(cfg: CacheConfig) -> Path:
    """Encode ``cfg.data`` into ``<run_dir>/cache/data`` (written to ``data.tmp`` and renamed, so a killed
    run leaves no half cache); returns ``cfg.model.pretrained`` when set, else the cache folder."""
    t0 = time.perf_counter()
    root = Path(cfg.run_dir) / "cache"
    out, tmp = root / "data", root / "data.tmp"
    encoder = text_encoder_from_config(cfg.text_encoder, device=cfg.device)
    codec = build_codec(cfg.codec, device=cfg.device)
    train, held = build_datasets(cfg.data, encoder)
    refuse_conditions(cfg.data, train, "a latent cache")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, root / "config.yaml")
    shards, pending, skipped = [], [], []
    stream = list(train.stream_counts()) if hasattr(train, "stream_counts") else None

    def flush():
        latents = torch.cat([p[0] for p in pending])
        embeds = PromptEmbeds.cat([p[1] for p in pending])
        name = f"latents-{len(shards):06d}.safetensors"
        write_shard(tmp / name, latents, embeds, sum((p[2] for p in pending), []), sum((p[3] for p in pending), []))
        shards.append({"file": name, "rows": len(latents)})
        pending.clear()

    with torch.no_grad():
        for images, captions, keys, bad in tqdm(_train_batches(train, cfg.batch_size), desc="caching",
                                               total=-(-len(train) // cfg.batch_size), dynamic_ncols=True):
            skipped += [message for _, message in bad]
            for j, _ in bad:  # the cached stream is the source's, less its bad samples
                stream[train.index.shard[int(train.ids[j])]] -= 1
            if images is None:
                continue
            latents = codec.encode(images.to(cfg.device).float() / 255.0).cpu()
            pending.append((latents, encoder.encode(captions).to("cpu"), keys, captions))
            if sum(len(p[0]) for p in pending) >= cfg.per_shard:
                flush()
        if pending:
            flush()
        held_images = (held.images.float() if held.images.dtype != torch.uint8 else held.images)
        write_shard(tmp / "heldout.safetensors", torch.empty(0), encoder.encode(held.captions).to("cpu"),
                    [str(i) for i in range(len(held))], held.captions, images=held_images.to(torch.uint8))
    manifest = {"format": FORMAT, "codec": codec.identity, "text_encoder": encoder.cache_key,
                "size": [cfg.data.size, cfg.data.size], "source": {"source": cfg.data.source, "path": cfg.data.path},
                "shards": shards, "rows": sum(s["rows"] for s in shards), "heldout": len(held),
                "skipped": len(skipped), "stream_counts": stream}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if skipped:
        log.warning("cache: skipped %d bad sample(s), first: %s", len(skipped), "; ".join(skipped[:5]))
    print(f"cache: {manifest['rows']} train rows in {len(shards)} shard(s) + {len(held)} held-out, codec "
          f"{manifest['codec']}, text encoder {manifest['text_encoder']}, {time.perf_counter() - t0:.1f} s -> {out}")
    return Path(cfg.model.pretrained) if cfg.model.pretrained else out
