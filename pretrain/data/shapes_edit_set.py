"""The shapes editing source (``data.source: shapes_edit``): edit prompts with their source images as
conditioning images and the edited scenes as images (:mod:`pretrain.data.shapes_edit`), cached like the
shapes source."""

from __future__ import annotations

import logging

import numpy as np
import torch
from tqdm.auto import tqdm

from pretrain.data import shapes, shapes_edit
from pretrain.data.dataset import DataConfig, EncodedSet, _cache_file, _read_cache, _write_cache, encode_repeated

log = logging.getLogger(__name__)


def load_shapes_edit(cfg: DataConfig) -> dict:
    """The shapes editing set (cached like :func:`load_shapes`): dict with ``images`` (targets) and
    ``conditions`` (sources) uint8 ``[N, 3, S, S]``, ``captions`` (edit prompts) and ``heldout`` (0/1 per
    row). Train rows: ``cfg.scenes`` edits drawn from those not held out (seed 0); held-out rows:
    ``heldout_per_category`` edits of each kind (colour, shape) from the ``heldout_fraction`` held out
    (:func:`pretrain.data.shapes_edit.is_novel`), with seeds the train rows never use."""
    key = (f"shapes-edit-{shapes.VERSION}_{cfg.size}px_n{cfg.scenes}_h{cfg.heldout_per_category}"
           f"_f{cfg.heldout_fraction:g}_{cfg.layout}")
    path = _cache_file(cfg, key)
    cached = _read_cache(path, ("images", "conditions", "heldout"), ("captions",))
    if cached is not None:
        return cached
    edits = shapes_edit.all_edits()
    novel = [e for e in edits if shapes_edit.is_novel(e, cfg.heldout_fraction)]
    seen = [e for e in edits if not shapes_edit.is_novel(e, cfg.heldout_fraction)]
    rng = np.random.default_rng([0, 13])
    train = [seen[int(i)] for i in rng.integers(len(seen), size=cfg.scenes)]
    held = []
    for op in shapes_edit.EDIT_OPS:
        pool = [e for e in novel if e.op == op]
        held += [pool[int(i)] for i in np.random.default_rng([1, 13]).permutation(len(pool))[:cfg.heldout_per_category]]
    rows = [(e, i) for i, e in enumerate(train)] + [(e, 1_000_000_000 + i) for i, e in enumerate(held)]
    pairs = [shapes_edit.render_edit(e, cfg.size, seed, cfg.layout)[:2]
             for e, seed in tqdm(rows, desc=f"rendering {len(rows)} shape edits", leave=False,
                                 disable=len(rows) < 1024, dynamic_ncols=True)]
    conditions = torch.from_numpy(np.stack([p[0] for p in pairs]))
    images = torch.from_numpy(np.stack([p[1] for p in pairs]))
    heldout = torch.tensor([0] * len(train) + [1] * len(held), dtype=torch.uint8)
    meta = dict(captions=[e.prompt for e, _ in rows])
    _write_cache(path, {"images": images, "conditions": conditions, "heldout": heldout}, meta)
    log.info("shapes_edit: %d train edits, %d held-out edits (of %d held out) at %d px", len(train), len(held),
             len(novel), cfg.size)
    return dict(images=images, conditions=conditions, heldout=heldout, **meta)


def shape_edit_sets(cfg: DataConfig, encoder) -> tuple[EncodedSet, EncodedSet]:
    """Train and held-out sets of the shapes editing source (:func:`load_shapes_edit`): targets as the
    images, edit prompts as the captions, sources as the conditioning images; ``limit`` as for shapes."""
    raw = load_shapes_edit(cfg)
    held = raw["heldout"].bool()
    out = []
    for want, cut in ((False, cfg.limit), (True, max(1, cfg.limit // 8) if cfg.limit else None)):
        idx = torch.as_tensor([i for i, h in enumerate(held.tolist()) if h == want][:cut])
        caps = [raw["captions"][i] for i in idx.tolist()]
        out.append(EncodedSet(raw["images"][idx], caps, encode_repeated(encoder, caps, cfg), raw["conditions"][idx]))
    return out[0], out[1]
