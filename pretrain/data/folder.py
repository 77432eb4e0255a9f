"""A user's own image-text data: a folder of images plus ``captions.jsonl``.

Each line of ``captions.jsonl`` is ``{"file": "relative/path.png", "caption": "..."}``, UTF-8. An editing
folder (InstructPix2Pix-style pairs) adds ``"source": "relative/input.png"`` to its lines: ``file`` is the
edited image (the target), ``caption`` the instruction and ``source`` the image it edits, read as the
prompt's conditioning image. A line that does not decode or parse, a ``file`` or ``source`` outside the
folder (absolute, ``..`` or a link out of it), a corrupt image (a decompression bomb included: a header
claiming more pixels than Pillow's limit), a missing image, an empty caption or, in an editing folder (one
where any line names a ``source``), a line without one is skipped and counted (one warning names the first
few); an empty result is an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SHOWN = 5  # skipped samples named per reason in the warning


class DatasetError(ValueError):
    """Raised when a dataset yields no usable sample or its index file is unreadable."""


@dataclass
class ImageFolder:
    """What :func:`load_image_folder` read: ``images`` uint8 ``[N, 3, S, S]`` (an editing folder's targets),
    ``captions`` (N strings; instructions in an editing folder), ``skipped`` (reason -> what was skipped),
    and for an editing folder ``sources`` uint8 ``[N, 3, S, S]`` with their ``source_files`` (paths relative
    to the folder, links and ``..`` resolved, so one file has one name) and the targets' ``files`` (named
    the same way); None for a text-to-image folder."""

    images: torch.Tensor
    captions: list[str]
    skipped: dict[str, list[str]] = field(default_factory=dict)
    sources: torch.Tensor | None = None
    source_files: list[str] | None = None
    files: list[str] | None = None

    def split_keys(self) -> list[str]:
        """One key per row, equal for rows that must fall on the same side of a train / held-out split: the
        caption of a text-to-image row; for an editing row, the first (sorted) source file among the rows
        that share a file with it, as source or as target, directly or through a chain of rows. So an image
        edited in one row and the output of another is never a held-out source while it trains as a target
        (or the reverse); a row whose files appear in no other row is keyed by its own source.
        Raises nothing."""
        if self.source_files is None or self.files is None:
            return list(self.captions)
        parent: dict[str, str] = {}

        def root(name: str) -> str:
            parent.setdefault(name, name)
            while parent[name] != name:
                parent[name] = parent[parent[name]]
                name = parent[name]
            return name

        for source, target in zip(self.source_files, self.files):
            a, b = root(source), root(target)
            if a != b:
                parent[max(a, b)] = min(a, b)
        first: dict[str, str] = {}
        for source in self.source_files:
            group = root(source)
            first[group] = min(first.get(group, source), source)
        return [first[root(source)] for source in self.source_files]


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


def read_rgb(path: str | Path, width: int, height: int) -> np.ndarray:
    """One image file as uint8 ``[height, width, 3]`` RGB: transparency composited on white, resized with
    Lanczos without keeping the aspect ratio. Raises ``OSError`` (missing or unreadable),
    ``PIL.UnidentifiedImageError`` (not an image), ``ValueError`` or ``PIL.Image.DecompressionBombError``
    (a header claiming more pixels than Pillow's limit)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        rgba = im.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB").resize((width, height), Image.LANCZOS))


def _read(path: Path, size: int, cache: dict[Path, np.ndarray]) -> tuple[np.ndarray | None, str | None]:
    """(``size`` x ``size`` pixels, None), or (None, "missing" / "corrupt") for a file that is not there or
    that PIL cannot read (a decompression bomb included); ``cache`` keeps what was read by path."""
    from PIL import Image, UnidentifiedImageError

    if path in cache:
        return cache[path], None
    if not path.is_file():
        return None, "missing"
    try:
        cache[path] = read_rgb(path, size, size)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None, "corrupt"
    return cache[path], None


def _rows(index: Path, skipped: dict[str, list[str]]) -> list[tuple[str, str, dict]]:
    """(``captions.jsonl:<line>``, stripped caption, the row) of each parsed line; undecodable and bad
    lines go to ``skipped``."""
    out = []
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
            out.append((where, str(row.get("caption") or "").strip(), {**row, "file": str(row["file"])}))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            skipped.setdefault("bad line", []).append(where)
    return out


def load_image_folder(root: str | Path, size: int) -> ImageFolder:
    """Read ``root/captions.jsonl`` and its images (and sources, in an editing folder), each resized to
    ``size`` x ``size`` RGB on white (:func:`read_rgb`).

    ``skipped`` maps a reason to what was skipped: ``captions.jsonl:<line>`` for "undecodable line" (not
    UTF-8), "bad line" (not a JSON object with ``file``), "path outside the folder" (an absolute ``file``
    or ``source``, or one that resolves outside ``root``) and, in an editing folder, "no source" (a line
    without ``source``); the ``file`` for "missing image", "corrupt image" and "empty caption"; the
    ``source`` for "missing source image" and "corrupt source image".
    Raises ``DatasetError`` naming the file if nothing usable remains or the index is missing."""
    root = Path(root)
    index = root / "captions.jsonl"
    if not index.is_file():
        raise DatasetError(f"{index}: missing (expected one JSON object per line with 'file' and 'caption')")
    skipped: dict[str, list[str]] = {}
    rows = _rows(index, skipped)
    editing = any(row.get("source") for _, _, row in rows)
    seen: dict[Path, np.ndarray] = {}  # sources read once however many edits they have
    resolved = root.resolve()
    images, captions, sources, source_files, files = [], [], [], [], []
    for where, caption, row in rows:
        if editing and not row.get("source"):
            skipped.setdefault("no source", []).append(where)
            continue
        path = _inside(resolved, row["file"])
        source = _inside(resolved, str(row["source"])) if editing else None
        if path is None or (editing and source is None):
            skipped.setdefault("path outside the folder", []).append(where)
            continue
        if not caption:
            skipped.setdefault("empty caption", []).append(row["file"])
            continue
        image, bad = _read(path, size, {})
        if bad:
            skipped.setdefault(f"{bad} image", []).append(row["file"])
            continue
        if editing:
            pixels, bad = _read(source, size, seen)
            if bad:
                skipped.setdefault(f"{bad} source image", []).append(str(row["source"]))
                continue
            sources.append(pixels)
            source_files.append(source.relative_to(resolved).as_posix())
            files.append(path.relative_to(resolved).as_posix())
        images.append(image)
        captions.append(caption)
    if skipped:
        log.warning("%s: kept %d sample(s), skipped %s", root, len(images), "; ".join(
            f"{len(names)} {reason} (first: {', '.join(names[:SHOWN])})" for reason, names in skipped.items()))
    if not images:
        raise DatasetError(f"{root}: no usable image-caption pair (skipped: "
                           f"{ {k: len(v) for k, v in skipped.items()} })")

    def stack(arrays):
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()

    return ImageFolder(stack(images), captions, skipped, stack(sources) if editing else None,
                       source_files if editing else None, files if editing else None)
