"""The on-disk cache of rendered sets, caption embeddings and shard indexes.

Cache files are safetensors (tensors, plus JSON metadata such as caption lists in the file's metadata),
never pickles: a cache folder shared with others cannot run code when read. The folder is
``data.cache_dir``, else ``$POSTTRAIN_CACHE``, else ``~/.cache/posttrain``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

if TYPE_CHECKING:
    from pretrain.data.dataset import DataConfig

log = logging.getLogger(__name__)

CACHE_FORMAT = "v2"  # in every cache file's name: v1 files were pickles (torch.save) and are never read


def cache_dir(cfg: DataConfig) -> Path:
    """The cache folder of ``cfg`` (created if missing)."""
    d = Path(cfg.cache_dir or os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain")
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_file(cfg: DataConfig, key: str) -> Path:
    """The cache file of ``key`` (its name carries the cache format)."""
    return cache_dir(cfg) / f"{key}.{CACHE_FORMAT}.safetensors"


def read_cache(path: Path, tensors: tuple[str, ...], meta: tuple[str, ...]) -> dict | None:
    """The tensors ``tensors`` and the metadata lists ``meta`` stored in ``path`` by :func:`write_cache`
    as one dict, or None (to rebuild) when the file is absent or unreadable (a warning then names it).
    A pickle left by an older version (same key, ``.pt``) is never read; a line says it is rebuilt."""
    if not path.is_file():
        old = path.with_name(path.name.removesuffix(f".{CACHE_FORMAT}.safetensors") + ".pt")
        if old.is_file():
            log.info("%s: old pickle cache, not loaded (a pickle can run code); rebuilding as %s", old, path.name)
        return None
    try:
        with safe_open(path, "pt") as f:
            out = {k: f.get_tensor(k) for k in tensors}
            stored = json.loads((f.metadata() or {})["meta"])
        out |= {k: list(stored[k]) for k in meta}
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as e:
        log.warning("%s: unreadable cache (%s: %s); rebuilding it", path, type(e).__name__, e)
        return None
    return out


def write_cache(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, list]) -> None:
    """Write ``tensors`` and the JSON-able ``meta`` to ``path`` (safetensors; atomically)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)
