"""The sources the project renders itself, with nothing to download: OpenMoji emoji, moving-emoji clips,
shapes scenes and shapes edits, each cached on disk under a key of what determines it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from pretrain.data import emoji as emoji_data
from pretrain.data import moving_emoji
from pretrain.data import shapes
from pretrain.data.disk_cache import cache_file, read_cache, write_cache
from pretrain.data.folder import DatasetError

if TYPE_CHECKING:
    from pretrain.data.dataset import DataConfig

log = logging.getLogger(__name__)


def load_openmoji(cfg: DataConfig) -> dict:
    """Rendered OpenMoji set (cached by package versions and resolution): dict with ``images`` uint8
    ``[N, 3, S, S]``, ``captions``, ``bases``, ``codepoints``, ``unnamed``. Raises ``DatasetError``
    if any rendered emoji is blank."""
    path = cache_file(cfg, emoji_data.emoji_cache_key(cfg.size))
    cached = read_cache(path, ("images",), ("captions", "bases", "codepoints", "unnamed"))
    if cached is not None:
        return cached
    records, unnamed = emoji_data.list_emoji()
    images = emoji_data.render_emoji([r.text for r in records], cfg.size)
    blank = emoji_data.blank_mask(images)
    if blank.any():
        names = [records[i].codepoints for i in blank.nonzero().flatten().tolist()]
        raise DatasetError(f"openmoji: {len(names)} emoji rendered blank, first: {names[:5]}")
    log.info("openmoji: %d named emoji rendered at %d px; %d unnamed left out (first: %s)",
             len(records), cfg.size, len(unnamed), unnamed[:5])
    meta = dict(captions=[r.caption for r in records], bases=[r.base for r in records],
                codepoints=[r.codepoints for r in records], unnamed=unnamed)
    write_cache(path, {"images": images}, meta)
    return dict(images=images, **meta)


def load_moving_emoji(cfg: DataConfig) -> dict:
    """The moving-emoji video set (cached by package versions, resolution, frames and motions): dict
    with ``images`` uint8 ``[N, F, 3, S, S]``, ``captions`` and ``bases`` (the held-out split key)."""
    key = f"moving_{emoji_data.emoji_cache_key(cfg.size)}_f{cfg.frames}_m{cfg.motions_per_emoji}"
    path = cache_file(cfg, key)
    cached = read_cache(path, ("images",), ("captions", "bases"))
    if cached is not None:
        return cached
    records, _ = emoji_data.list_emoji()
    videos, captions, bases = moving_emoji.build_clips([r.text for r in records], [r.caption for r in records],
                                                       [r.base for r in records], cfg.frames, cfg.size,
                                                       cfg.motions_per_emoji)
    write_cache(path, {"images": videos}, dict(captions=captions, bases=bases))
    return dict(images=videos, captions=captions, bases=bases)


def load_shapes(cfg: DataConfig) -> dict:
    """The shapes set (cached by grammar version, resolution, scene count, held-out share and layout): dict with
    ``images`` uint8 ``[N, 3, S, S]``, ``captions`` and ``heldout`` (0/1 per row). Train rows are
    ``cfg.scenes`` renders of specs drawn by category (:func:`pretrain.data.shapes.draw_specs`, seed 0); held-out
    rows are one render each of :func:`pretrain.data.shapes.heldout_specs` with seeds the train rows never use."""
    key = (f"shapes-{shapes.VERSION}_{cfg.size}px_n{cfg.scenes}_h{cfg.heldout_per_category}_f{cfg.heldout_fraction:g}"
           + ("" if cfg.layout == "random" else f"_{cfg.layout}"))
    path = cache_file(cfg, key)
    cached = read_cache(path, ("images", "heldout"), ("captions",))
    if cached is not None:
        return cached
    seen, novel = shapes.split_specs(cfg.heldout_fraction)
    train = shapes.draw_specs(seen, cfg.scenes, seed=0)
    held = shapes.heldout_specs(novel, seen, cfg.heldout_per_category)
    specs_seeds = [(s, i) for i, s in enumerate(train)] + [(s, 1_000_000_000 + i) for i, s in enumerate(held)]
    images = torch.from_numpy(np.stack([
        shapes.render_spec(s, cfg.size, seed, cfg.layout)[0]
        for s, seed in tqdm(specs_seeds, desc=f"rendering {len(specs_seeds)} shape scenes", leave=False,
                            disable=len(specs_seeds) < 1024, dynamic_ncols=True)]))
    heldout = torch.tensor([0] * len(train) + [1] * len(held), dtype=torch.uint8)
    meta = dict(captions=[s.caption for s, _ in specs_seeds])
    write_cache(path, {"images": images, "heldout": heldout}, meta)
    log.info("shapes: %d train scenes of %d specs, %d held-out prompts (%d novel specs) at %d px",
             len(train), len(seen), len(held), len(novel), cfg.size)
    return dict(images=images, heldout=heldout, **meta)


def load_shapes_edit(cfg: DataConfig) -> dict:
    """The shapes editing set (cached like :func:`load_shapes`): dict with ``images`` (targets) and
    ``conditions`` (sources) uint8 ``[N, 3, S, S]``, ``captions`` (edit prompts) and ``heldout`` (0/1 per
    row). Train rows: ``cfg.scenes`` edits drawn from those not held out (seed 0); held-out rows:
    ``heldout_per_category`` edits of each kind (colour, shape) from the ``heldout_fraction`` held out
    (:func:`pretrain.data.shapes.is_novel_edit`), with seeds the train rows never use."""
    key = (f"shapes-edit-{shapes.VERSION}_{cfg.size}px_n{cfg.scenes}_h{cfg.heldout_per_category}"
           f"_f{cfg.heldout_fraction:g}_{cfg.layout}")
    path = cache_file(cfg, key)
    cached = read_cache(path, ("images", "conditions", "heldout"), ("captions",))
    if cached is not None:
        return cached
    edits = shapes.all_edits()
    novel = [e for e in edits if shapes.is_novel_edit(e, cfg.heldout_fraction)]
    seen = [e for e in edits if not shapes.is_novel_edit(e, cfg.heldout_fraction)]
    rng = np.random.default_rng([0, 13])
    train = [seen[int(i)] for i in rng.integers(len(seen), size=cfg.scenes)]
    held = []
    for op in shapes.EDIT_OPS:
        pool = [e for e in novel if e.op == op]
        held += [pool[int(i)] for i in np.random.default_rng([1, 13]).permutation(len(pool))[:cfg.heldout_per_category]]
    rows = [(e, i) for i, e in enumerate(train)] + [(e, 1_000_000_000 + i) for i, e in enumerate(held)]
    pairs = [shapes.render_edit(e, cfg.size, seed, cfg.layout)[:2]
             for e, seed in tqdm(rows, desc=f"rendering {len(rows)} shape edits", leave=False,
                                 disable=len(rows) < 1024, dynamic_ncols=True)]
    conditions = torch.from_numpy(np.stack([p[0] for p in pairs]))
    images = torch.from_numpy(np.stack([p[1] for p in pairs]))
    heldout = torch.tensor([0] * len(train) + [1] * len(held), dtype=torch.uint8)
    meta = dict(captions=[e.prompt for e, _ in rows])
    write_cache(path, {"images": images, "conditions": conditions, "heldout": heldout}, meta)
    log.info("shapes_edit: %d train edits, %d held-out edits (of %d held out) at %d px", len(train), len(held),
             len(novel), cfg.size)
    return dict(images=images, conditions=conditions, heldout=heldout, **meta)
