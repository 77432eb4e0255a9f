"""A user's own image-text data: a folder of images plus ``captions.jsonl``.

Each line of ``captions.jsonl`` is ``{"file": "relative/path.png", "caption": "..."}``, UTF-8. A line that
does not decode or parse, a ``file`` outside the folder (absolute, ``..`` or a link out of it), a corrupt
image (a decompression bomb included: a header claiming more pixels than Pillow's limit) or a missing image or an empty caption is skipped and counted (one warning names the first few); an empty
result is an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SHOWN = 5  # skipped samples named per reason in the warning


class DatasetError(ValueError):
    """Raised when a dataset yields no usable sample or its index file is unreadable."""


def _inside(root: Path, name: str) -> Path | None:
    """``root / name`` resolved (links followed) if ``name`` is relative and stays inside ``root`` (a
    resolved path), else None."""
    if Path(name).is_absolute():
        return None
    try:
        path = (root / name).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a link loop
        return None
    return path if path.is_relative_to(root) else None


def load_image_folder(root: str | Path, size: int) -> tuple[torch.Tensor, list[str], dict[str, list[str]]]:
    """Read ``root/captions.jsonl`` and its images, resized to ``size`` x ``size`` RGB on white.

    Returns (uint8 ``[N, 3, size, size]``, captions, skipped) where ``skipped`` maps a reason to what was
    skipped: ``captions.jsonl:<line>`` for "undecodable line" (not UTF-8), "bad line" (not a JSON object
    with ``file``) and "path outside the folder" (an absolute ``file``, or one that resolves outside
    ``root``); the ``file`` for "missing image", "corrupt image" and "empty caption".
    Raises ``DatasetError`` naming the file if nothing usable remains or the index is missing."""
    from PIL import Image, UnidentifiedImageError

    root = Path(root)
    index = root / "captions.jsonl"
    if not index.is_file():
        raise DatasetError(f"{index}: missing (expected one JSON object per line with 'file' and 'caption')")
    images, captions = [], []
    skipped: dict[str, list[str]] = {}
    resolved = root.resolve()
    data = index.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
    for lineno, raw in enumerate(data.splitlines(), 1):
        where = f"{index.name}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.setdefault("undecodable line", []).append(where)
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name, caption = str(row["file"]), str(row.get("caption") or "").strip()
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            skipped.setdefault("bad line", []).append(where)
            continue
        path = _inside(resolved, name)
        if path is None:
            skipped.setdefault("path outside the folder", []).append(where)
            continue
        if not caption:
            skipped.setdefault("empty caption", []).append(name)
            continue
        if not path.is_file():
            skipped.setdefault("missing image", []).append(name)
            continue
        try:
            with Image.open(path) as im:
                im.load()
                rgba = im.convert("RGBA")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            skipped.setdefault("corrupt image", []).append(name)  # a bomb: a header claiming too many pixels
            continue
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, rgba).convert("RGB").resize((size, size), Image.LANCZOS)
        images.append(np.asarray(rgb))
        captions.append(caption)
    if skipped:
        log.warning("%s: kept %d sample(s), skipped %s", root, len(images), "; ".join(
            f"{len(names)} {reason} (first: {', '.join(names[:SHOWN])})" for reason, names in skipped.items()))
    if not images:
        raise DatasetError(f"{root}: no usable image-caption pair (skipped: "
                           f"{ {k: len(v) for k, v in skipped.items()} })")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), captions, skipped
