"""`posttrain curate CONFIG`: score the train split of an image dataset with rewards, keep the samples
that pass score rules, drop near-duplicate images (perceptual hash), and write what is left as a folder
dataset (``data.source: folder``) with a report.

Order: score every train sample (``rewards``, as GRPO's block: the weighted total and each raw
reward), apply ``filters`` in order (each rule sees only the samples the earlier rules kept), then
deduplicate the survivors. The held-out split of ``data`` is never curated nor written: it stays the
evaluation set of the source.

Outputs under ``<run_dir>/curate/``: ``data/`` (``captions.jsonl`` + ``images/NNNNNN.png``, or tar shards
with ``shard_size``, plus
``curate.json``: the config it was made with, a hash of the source, counts and timings), ``report.md``,
``hist_<reward>.png`` (and ``hist_total.png``), ``grid_kept.png``, ``grid_dropped.png``,
``grid_duplicates.png`` (:mod:`posttrain.curate.report`), ``config.yaml`` (resolved).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from pretrain.config import require_positive, save_config
from pretrain.data.dataset import DataConfig, build_datasets, refuse_conditions
from pretrain.extras import require
from rewards.base import CompositeReward, check_reward_weights, parse_reward_specs

IMAGE_SOURCES = ("openmoji", "folder", "moving_emoji")  # the in-memory sources with pixels (images or videos)
TOTAL = "total"  # the weighted sum of the rewards, as a filter's ``reward``
NOT_MATCHED = ("run_dir", "overwrite", "model", "batch_size", "grid_samples")  # do not change the data
DEDUP_METHODS = ("phash", "none")


@dataclass
class CurateModel:
    """``pretrained``: an export passed through untouched (``curate`` returns it), so that a pipeline's
    next stage continues from the same model; not used for scoring."""

    pretrained: str | None = None


@dataclass
class FilterRule:
    """Keep a sample when its ``reward`` score (a reward name of ``rewards``, or ``total``) is finite,
    within [``min``, ``max``] (inclusive; None = no bound), and, with ``top_fraction`` f, among the
    ceil(f * n) highest of the n samples that reached this rule with a finite score within the bounds
    (ties: the lower index first). A NaN score fails the rule and is counted as "not applicable"."""

    reward: str = TOTAL
    min: float | None = None
    max: float | None = None
    top_fraction: float | None = None

    def validate(self, prefix: str = "") -> None:
        if self.min is None and self.max is None and self.top_fraction is None:
            raise ValueError(f"{prefix.rstrip('.')}: a rule needs min, max or top_fraction")
        if self.top_fraction is not None and not 0 < self.top_fraction <= 1:
            raise ValueError(f"{prefix}top_fraction: must be in (0, 1], got {self.top_fraction}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"{prefix}min: min {self.min} > max {self.max}")

    def describe(self) -> str:
        parts = ([f">= {self.min:g}"] if self.min is not None else []) + \
                ([f"<= {self.max:g}"] if self.max is not None else []) + \
                ([f"top {self.top_fraction:.4g}"] if self.top_fraction is not None else [])
        return f"{self.reward} " + ", ".join(parts)


@dataclass
class DedupConfig:
    """``method``: "phash" (``imagehash.phash`` of each image in grayscale, ``hash_size`` x ``hash_size``
    bits) or "none". Two samples are near-duplicates when their hashes differ in at most
    ``max_distance`` bits; of each such pair the one with the higher total score stays (ties: the
    lower index). phash reads a ``4 * hash_size`` px square: smaller images are upscaled to it first
    (Lanczos), larger ones downscaled by phash itself."""

    method: str = "phash"
    max_distance: int = 4
    hash_size: int = 8

    def validate(self, prefix: str = "") -> None:
        if self.method not in DEDUP_METHODS:
            raise ValueError(f"{prefix}method: unknown '{self.method}' (known: {', '.join(DEDUP_METHODS)})")
        if self.method == "phash":
            import importlib.util

            if importlib.util.find_spec("imagehash") is None:
                raise ValueError(f"{prefix}method: 'phash' needs the package imagehash, which is not installed: "
                                 f"pip install 'posttrain[data]' (or {prefix}method=none)")
        if self.hash_size < 2:
            raise ValueError(f"{prefix}hash_size: must be >= 2, got {self.hash_size}")
        if not 0 <= self.max_distance <= self.hash_size ** 2:
            raise ValueError(f"{prefix}max_distance: must be in [0, hash_size**2 = {self.hash_size ** 2}], "
                             f"got {self.max_distance}")


@dataclass
class CurateConfig:
    """``run_dir``: outputs go to ``<run_dir>/curate/``; ``model``: passed through (:class:`CurateModel`);
    ``data``: the source (openmoji, folder or moving_emoji clips; its train split is curated); ``rewards``: ``{name: weight}``
    or ``{name: {weight: w, <params>}}`` as GRPO's (dict values from the command line merge into the
    file's: switch one off with weight 0); ``batch_size``: images per reward call; ``filters``: the
    rules (:class:`FilterRule`) in order; ``dedup`` (:class:`DedupConfig`); ``grid_samples``: cells per
    report grid; ``overwrite``: replace an existing ``data/`` made with another config or source
    (without it, the same config and source reuse the folder and anything else is refused);
    ``shard_size``: 0 writes the folder layout, N > 0 WebDataset tar shards of N samples (png, txt and a
    json member with the source index and scores), read by ``data.source: shards``."""

    run_dir: str = "runs/curate"
    model: CurateModel = field(default_factory=CurateModel)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 256
    filters: list[FilterRule] = field(default_factory=list)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    grid_samples: int = 32
    overwrite: bool = False
    shard_size: int = 0

    def validate(self, prefix: str = "") -> None:
        if self.data.source not in IMAGE_SOURCES:
            raise ValueError(f"{prefix}data.source: curate scores images; '{self.data.source}' has none "
                             f"(use one of {', '.join(IMAGE_SOURCES)})")
        require_positive(self, prefix, "batch_size", "grid_samples")
        if self.shard_size < 0:
            raise ValueError(f"{prefix}shard_size: must be >= 0 (0 writes a folder), got {self.shard_size}")
        if self.data.source == "moving_emoji" and not self.shard_size:
            raise ValueError(f"{prefix}shard_size: video clips are written as tar shards of mp4s; set shard_size > 0")
        check_reward_weights(self.rewards, f"{prefix}rewards")
        names = [n for n, s in parse_reward_specs(self.rewards, f"{prefix}rewards").items() if s.weight != 0]
        if TOTAL in names:
            raise ValueError(f"{prefix}rewards.{TOTAL}: the name is taken by the weighted total")
        for i, rule in enumerate(self.filters):  # list items: not reached by pretrain.config.validate
            rule.validate(f"{prefix}filters.{i}.")
            if rule.reward not in (TOTAL, *names):
                raise ValueError(f"{prefix}filters.{i}.reward: '{rule.reward}' is not '{TOTAL}' nor a reward "
                                 f"with a non-zero weight ({names})")


@dataclass
class Curation:
    """What one run decided, for the report. ``images`` uint8 ``[N, 3, H, W]`` and ``captions`` of the
    train split; ``scores``: ``{"total" | reward name: float64 [N]}`` (NaN = not applicable);
    ``kept`` bool ``[N]``; ``reasons``: per sample None (kept) or a short label ("r1 < min", "r1 n/a",
    "dup of #12 (d=0)"); ``rules``: per rule a dict of counts (``reached``, ``kept``, ``dropped``,
    ``not_applicable``) and its ``rule`` text; ``duplicates``: dropped index -> (kept index, distance);
    ``heldout``: held-out samples left out; ``seconds``: phase -> wall seconds."""

    images: torch.Tensor
    captions: list[str]
    scores: dict[str, np.ndarray]
    kept: np.ndarray
    reasons: list[str | None]
    rules: list[dict]
    duplicates: dict[int, tuple[int, int]]
    heldout: int
    seconds: dict[str, float] = field(default_factory=dict)


def score(images: torch.Tensor, captions: list[str], reward: CompositeReward,
          batch_size: int) -> dict[str, np.ndarray]:
    """Score uint8 ``[N, 3, H, W]`` images (passed as float [0, 1]) with their captions as prompts, in
    batches: ``{"total": float64 [N], <name>: float64 [N] raw}`` (NaN = not applicable)."""
    parts: dict[str, list[np.ndarray]] = {}
    with tqdm(total=len(captions), desc=f"scoring {len(captions)} images", unit="img", mininterval=1.0) as bar:
        for s in range(0, len(captions), batch_size):
            total, raw = reward(images[s:s + batch_size].float() / 255.0, captions[s:s + batch_size])
            for name, value in {TOTAL: total, **raw}.items():
                parts.setdefault(name, []).append(value.detach().cpu().double().numpy())
            bar.update(min(batch_size, len(captions) - s))
    return {k: np.concatenate(v) for k, v in parts.items()}


def apply_filters(scores: dict[str, np.ndarray],
                  rules: list[FilterRule]) -> tuple[np.ndarray, list[str | None], list[dict]]:
    """(kept bool ``[N]``, reasons, per-rule counts) of ``rules`` applied in order (see :class:`FilterRule`).
    A dropped sample's reason names the first rule it failed: "r<k> n/a" (NaN), "r<k> < min",
    "r<k> > max" or "r<k> not top <f>" (k counts from 1)."""
    n = len(scores[TOTAL])
    alive = np.ones(n, dtype=bool)
    reasons: list[str | None] = [None] * n
    counts = []
    for k, rule in enumerate(rules, 1):
        s = scores[rule.reward]
        finite = np.isfinite(s)
        checks = [(alive & ~finite, "n/a")]
        ok = alive & finite
        if rule.min is not None:
            checks.append((ok & ~(np.where(finite, s, 0) >= rule.min), "< min"))
        if rule.max is not None:
            checks.append((ok & ~(np.where(finite, s, 0) <= rule.max), "> max"))
        for fail, _ in checks[1:]:
            ok &= ~fail
        if rule.top_fraction is not None:
            idx = np.flatnonzero(ok)
            top = idx[np.lexsort((idx, -s[idx]))][:math.ceil(rule.top_fraction * len(idx) - 1e-9)]
            fail = ok.copy()
            fail[top] = False
            checks.append((fail, f"not top {rule.top_fraction:.4g}"))
            ok &= ~fail
        for fail, label in checks:
            for i in np.flatnonzero(fail):
                reasons[i] = reasons[i] or f"r{k} {label}"
        na = int(checks[0][0].sum())
        counts.append({"rule": rule.describe(), "reached": int(alive.sum()), "kept": int(ok.sum()),
                       "dropped": int(alive.sum() - ok.sum()) - na, "not_applicable": na})
        alive = ok
    return alive, reasons, counts


def phash_bits(images: torch.Tensor, hash_size: int = 8) -> np.ndarray:
    """bool ``[N, hash_size**2]``: ``imagehash.phash`` of each uint8 ``[N, 3, H, W]`` image, upscaled
    (Lanczos) to ``4 * hash_size`` px first when smaller."""
    from PIL import Image

    from pretrain.extras import require

    imagehash = require("imagehash", "dedup.method: phash")
    side = 4 * hash_size
    out = np.empty((len(images), hash_size * hash_size), dtype=bool)
    for i, arr in enumerate(images.permute(0, 2, 3, 1).numpy()):
        img = Image.fromarray(arr)
        if min(img.size) < side:
            img = img.resize((side, side), Image.LANCZOS)
        out[i] = imagehash.phash(img, hash_size=hash_size).hash.flatten()
    return out


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per element of a uint64 array (``np.bitwise_count`` on numpy >= 2, a byte table before)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    table = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)
    return table[words.view(np.uint8)].reshape(*words.shape, 8).sum(-1)


def near_pairs(bits: np.ndarray, max_distance: int,
               block_elems: int = 1 << 22) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All pairs (i < j) of rows of bool ``bits`` ``[N, K]`` at Hamming distance <= ``max_distance``:
    (i, j, distance) int64 arrays, sorted by i then j. Rows are packed into uint64 words and compared
    a block of rows against all later rows at a time (``block_elems`` words per block)."""
    n = bits.shape[0]
    packed = np.packbits(bits, axis=1)
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 8))).view(np.uint64)  # [N, W]
    rows = max(1, block_elems // max(1, n * packed.shape[1]))
    found = []
    for s in range(0, n, rows):
        a, b = packed[s:s + rows], packed[s:]
        dist = _popcount(a[:, None, :] ^ b[None, :, :]).sum(-1, dtype=np.int64)  # [rows, N - s]
        ii, jj = np.nonzero(dist <= max_distance)
        upper = jj > ii  # j indexes from s: pairs with i < j only
        found.append((ii[upper] + s, jj[upper] + s, dist[ii[upper], jj[upper]]))
    if not found:
        return (np.zeros(0, np.int64),) * 3
    return tuple(np.concatenate(x).astype(np.int64) for x in zip(*found))


def drop_duplicates(candidates: np.ndarray, total: np.ndarray, pairs) -> dict[int, tuple[int, int]]:
    """Greedy near-duplicate removal: ``candidates`` (sample indices) in order of ``total`` (descending,
    NaN last, ties by index) keep their place unless an earlier-kept one is within distance; each
    kept sample drops its not yet dropped neighbours. ``pairs``: (i, j, d) arrays of positions in
    ``candidates``. Returns {dropped sample index: (kept sample index, distance)}."""
    neighbours: dict[int, list[tuple[int, int]]] = {}
    for i, j, d in zip(*(p.tolist() for p in pairs)):
        neighbours.setdefault(i, []).append((j, d))
        neighbours.setdefault(j, []).append((i, d))
    t = np.nan_to_num(total[candidates], nan=-np.inf)
    order = np.lexsort((candidates, -t))
    dropped: dict[int, tuple[int, int]] = {}
    for p in order.tolist():
        if p in dropped:
            continue
        for q, d in neighbours.get(p, []):
            dropped.setdefault(q, (p, d))
    return {int(candidates[q]): (int(candidates[p]), d) for q, (p, d) in dropped.items()}


def write_folder(out: Path, images: torch.Tensor, captions: list[str], scores: dict[str, np.ndarray],
                 keep: np.ndarray) -> None:
    """Write samples ``keep`` (indices) as a folder dataset: ``out/images/NNNNNN.png`` and
    ``out/captions.jsonl`` lines ``{"file", "caption", "source_index", "scores"}`` (NaN as null;
    :func:`pretrain.data.folder.load_image_folder` reads ``file`` and ``caption``)."""
    from PIL import Image

    (out / "images").mkdir(parents=True)
    lines = []
    for k, i in enumerate(keep.tolist()):
        name = f"images/{k:06d}.png"
        Image.fromarray(images[i].permute(1, 2, 0).numpy()).save(out / name)
        s = {n: (float(v[i]) if math.isfinite(v[i]) else None) for n, v in scores.items()}
        lines.append(json.dumps({"file": name, "caption": captions[i], "source_index": i, "scores": s},
                                ensure_ascii=False))
    (out / "captions.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def stills(images: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` as they are; videos ``[N, F, 3, H, W]`` as their middle frames (what
    near-duplicate hashing and the report's grids look at)."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


def write_shards(out: Path, images: torch.Tensor, captions: list[str], scores: dict[str, np.ndarray],
                 keep: np.ndarray, per_shard: int) -> None:
    """Write samples ``keep`` (indices) as WebDataset tar shards of ``per_shard`` samples in ``out``
    (:func:`pretrain.data.shards.write_tar_shards`): keys ``NNNNNN``, a PNG (an MP4 at 8 fps for a video
    ``[N, F, 3, H, W]``), the caption, and a json member ``{"caption", "source_index", "scores"}`` (NaN
    as null)."""
    import io

    from PIL import Image

    from pretrain.data.shards import write_tar_shards

    def samples():
        for k, i in enumerate(keep.tolist()):
            if images.ndim == 5:
                iio = require("imageio.v3", "curating video clips")
                data = iio.imwrite("<bytes>", images[i].permute(0, 2, 3, 1).numpy(), extension=".mp4", plugin="FFMPEG",
                                   fps=8, macro_block_size=1)
            else:
                buf = io.BytesIO()
                Image.fromarray(images[i].permute(1, 2, 0).numpy()).save(buf, "PNG")
                data = buf.getvalue()
            s = {n: (float(v[i]) if math.isfinite(v[i]) else None) for n, v in scores.items()}
            yield (f"{k:06d}", data, captions[i], {"caption": captions[i], "source_index": i, "scores": s},
                   "mp4" if images.ndim == 5 else "png")

    write_tar_shards(samples(), out, per_shard)


def _identity(cfg: CurateConfig, images: torch.Tensor, captions: list[str]) -> dict:
    """What makes the output: the config without the keys of ``NOT_MATCHED``, and a hash of the source's
    train images and captions."""
    conf = OmegaConf.to_container(OmegaConf.structured(cfg))
    digest = hashlib.sha256(images.numpy().tobytes())
    digest.update("\n".join(captions).encode())
    return {"config": {k: v for k, v in conf.items() if k not in NOT_MATCHED}, "source_sha256": digest.hexdigest()}


def _reusable(data: Path, identity: dict, overwrite: bool) -> bool:
    """True when ``data`` holds the output of the same config and source; False when absent or
    ``overwrite``; ``ValueError`` naming ``overwrite`` otherwise."""
    if not data.exists() or overwrite:
        return False
    try:
        made = json.loads((data / "curate.json").read_text())
    except (OSError, json.JSONDecodeError):
        made = None
    if isinstance(made, dict) and {k: made.get(k) for k in identity} == identity:
        return True
    why = "has no readable curate.json" if not isinstance(made, dict) else \
        "was made from another source" if made.get("source_sha256") != identity["source_sha256"] else \
        "was made with another config (differs in: " + ", ".join(sorted(
            k for k in {*identity["config"], *(made.get("config") or {})}
            if identity["config"].get(k) != (made.get("config") or {}).get(k))) + ")"
    raise ValueError(f"overwrite: {data} exists and {why}; set overwrite=true to replace it")


def _replace(tmp: Path, data: Path) -> None:
    """Move the finished ``tmp`` folder to ``data`` (an existing ``data`` is removed after the move)."""
    old = data.with_name(data.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if data.exists():
        os.replace(data, old)
    os.replace(tmp, data)
    shutil.rmtree(old, ignore_errors=True)


def curate(cfg: CurateConfig) -> Path:
    """Score, filter, deduplicate and write (see the module docstring). Returns ``Path(cfg.model.pretrained)``
    when set (the export the next stage continues from), else the written ``data/`` folder. Reuses an
    existing ``data/`` made with the same config and source (prints "reusing"). ``ValueError`` naming
    ``overwrite`` when ``data/`` exists otherwise, naming ``filters`` when no sample is left (the
    report is written); ``DatasetError`` when the source has no usable sample."""
    from posttrain.curate.report import write_report
    from pretrain.text_encoder import NoTextEmbeds

    t0 = time.perf_counter()
    root = Path(cfg.run_dir) / "curate"
    data, tmp = root / "data", root / "data.tmp"
    passed = Path(cfg.model.pretrained) if cfg.model.pretrained else data
    train, held = build_datasets(cfg.data, NoTextEmbeds())
    refuse_conditions(cfg.data, train, "curate's output (a folder or shards of images and captions)")
    identity = _identity(cfg, train.images, train.captions)
    if _reusable(data, identity, cfg.overwrite):
        print(f"curate: reusing {data} (same config and source; overwrite=true makes it anew)")
        return passed
    root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, root / "config.yaml")
    seconds = {"load": time.perf_counter() - t0}

    t = time.perf_counter()
    scores = score(train.images, train.captions, CompositeReward(cfg.rewards), cfg.batch_size)
    seconds["score"] = time.perf_counter() - t
    kept, reasons, rules = apply_filters(scores, cfg.filters)
    duplicates: dict[int, tuple[int, int]] = {}
    if cfg.dedup.method == "phash":
        t = time.perf_counter()
        candidates = np.flatnonzero(kept)
        bits = phash_bits(stills(train.images)[torch.as_tensor(candidates)], cfg.dedup.hash_size)
        seconds["hash"] = time.perf_counter() - t
        t = time.perf_counter()
        duplicates = drop_duplicates(candidates, scores[TOTAL], near_pairs(bits, cfg.dedup.max_distance))
        seconds["pairs"] = time.perf_counter() - t
        for i, (j, d) in duplicates.items():
            kept[i], reasons[i] = False, f"dup of #{j} (d={d})"

    t = time.perf_counter()
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    (write_shards if cfg.shard_size else write_folder)(tmp, train.images, train.captions, scores, np.flatnonzero(kept),
                                                       *([cfg.shard_size] if cfg.shard_size else []))
    result = Curation(stills(train.images), train.captions, scores, kept, reasons, rules, duplicates, len(held),
                      seconds)
    seconds["write"] = time.perf_counter() - t
    t = time.perf_counter()
    report = write_report(root, cfg, result, data)
    seconds |= {"report": time.perf_counter() - t, "total": time.perf_counter() - t0}
    if not kept.any():
        shutil.rmtree(tmp)
        raise ValueError(f"filters: no sample is left of {len(kept)} (counts and histograms: {report})")
    manifest = {**identity, "samples": int(kept.sum()), "train_samples": len(kept), "heldout_left_out": len(held),
                "rules": rules, "duplicates_dropped": len(duplicates), "seconds": seconds}
    (tmp / "curate.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _replace(tmp, data)
    print(f"curate: kept {int(kept.sum())} of {len(kept)} train samples in {seconds['total']:.1f} s -> {data}; "
          f"report: {report}")
    return passed
