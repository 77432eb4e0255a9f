"""A user's own image-text data: a folder of images plus ``captions.jsonl``.

Each line of ``captions.jsonl`` is ``{"file": "relative/path.png", "caption": "..."}``. A corrupt or
missing image or an empty caption is skipped and counted (the log names the first few); an empty
result is an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """Raised when a dataset yields no usable sample or its index file is unreadable."""


def load_image_folder(root: str | Path, size: int) -> tuple[torch.Tensor, list[str], dict[str, list[str]]]:
    """Read ``root/captions.jsonl`` and its images, resized to ``size`` x ``size`` RGB on white.

    Returns (uint8 ``[N, 3, size, size]``, captions, skipped) where ``skipped`` maps a reason
    ("missing image", "corrupt image", "empty caption", "bad line") to the sample names skipped.
    Raises ``DatasetError`` naming the file if nothing usable remains or the index is missing."""
    from PIL import Image, UnidentifiedImageError

    root = Path(root)
    index = root / "captions.jsonl"
    if not index.is_file():
        raise DatasetError(f"{index}: missing (expected one JSON object per line with 'file' and 'caption')")
    images, captions = [], []
    skipped: dict[str, list[str]] = {}
    for lineno, line in enumerate(index.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name, caption = str(row["file"]), str(row.get("caption") or "").strip()
        except (json.JSONDecodeError, KeyError, TypeError):
            skipped.setdefault("bad line", []).append(f"{index.name}:{lineno}")
            continue
        if not caption:
            skipped.setdefault("empty caption", []).append(name)
            continue
        path = root / name
        if not path.is_file():
            skipped.setdefault("missing image", []).append(name)
            continue
        try:
            with Image.open(path) as im:
                im.load()
                rgba = im.convert("RGBA")
        except (UnidentifiedImageError, OSError, ValueError):
            skipped.setdefault("corrupt image", []).append(name)
            continue
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, rgba).convert("RGB").resize((size, size), Image.LANCZOS)
        images.append(np.asarray(rgb))
        captions.append(caption)
    for reason, names in skipped.items():
        log.warning("%s: skipped %d sample(s) with %s, first: %s", root, len(names), reason, names[:5])
    if not images:
        raise DatasetError(f"{root}: no usable image-caption pair (skipped: "
                           f"{ {k: len(v) for k, v in skipped.items()} })")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), captions, skipped
