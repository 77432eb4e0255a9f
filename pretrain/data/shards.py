"""Sharded image-caption sets read lazily: WebDataset tar shards and parquet files.

A **tar shard** follows the WebDataset convention (what ``webdataset.ShardWriter``, img2dataset and
LAION write): members ``<key>.<ext>`` grouped into one sample per key, an image under ``jpg``, ``jpeg``,
``png`` or ``webp`` (or a video clip under ``mp4``, ``webm``, ``mkv``, ``mov`` or ``avi``, decoded by
imageio's ffmpeg plugin: :func:`decode_video`) and a caption under ``txt`` or ``caption`` (UTF-8) or
``json`` (its ``"caption"``).
A **parquet shard** has one row per sample: an image column (bytes, or a ``{"bytes": ...}`` struct as
Hugging Face ``datasets`` writes its ``Image`` feature), a caption column and optionally a key column.

The set is read by random access through an **index** (per shard: the keys, and per key the byte range of
each tar member or the parquet row group and row), built once by reading tar headers and image headers
(never decoding pixels) and cached under the data cache folder, keyed by the shards' paths, sizes and
modification times. Random access is what lets the sample order be a function of (seed, epoch) and
the index alone (:mod:`pretrain.data.stream`), so every world size reads the same global stream and
each rank reads only its own samples. ``webdataset`` 1.x reads tar shards as streams split by
(rank, worker), which ties the order to the world size; it writes the shards here
(:func:`write_tar_shards`).

Hostile input never stops a run and is never replaced silently: a truncated tar keeps the samples whose
bytes are all there (the shard is named, with how many it kept, at indexing); a sample with no image, an
undecodable image, an image whose header claims more than ``max_pixels`` pixels, or a missing or empty
caption is skipped when read, and :class:`BadSample` names the shard, key and reason for the caller to
count.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import tarfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.data.folder import DatasetError
from pretrain.extras import require

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")
CAPTION_EXTS = ("txt", "caption", "json")
INDEX_VERSION = 1
HEADER_BYTES = 1 << 16  # bytes of an image read to learn its size at indexing
OPEN_FILES = 64  # shard files a reader keeps open (per process; an LRU)
ROW_GROUPS = 16  # decoded parquet row groups a reader keeps (per process; an LRU): the shuffle buffer
# spreads consecutive reads over a few groups
MAX_FRAMES = 100_000  # frames counted at most in a clip without a duration (more: "video too long")


class BadSample(Exception):
    """A sample that cannot be used: ``shard`` (file name), ``key`` and ``reason`` ("no image",
    "corrupt image", "image too large", "missing caption", "unreadable bytes")."""

    def __init__(self, shard: str, key: str, reason: str):
        super().__init__(f"{shard}:{key}: {reason}")
        self.shard, self.key, self.reason = shard, key, reason


@dataclass
class ShardIndex:
    """The index of a shard set. ``shards``: file paths; per sample (in shard order, then file order):
    ``shard`` (index into ``shards``), ``key``, ``where`` (tar: ``{ext: [offset, size]}``; parquet:
    ``[row_group, row]``) and ``size`` (image ``[width, height]`` from its header, ``[0, 0]`` when the
    header is unreadable). ``truncated``: per shard that ends early (a cut tar, an unreadable parquet
    footer), the samples kept from it (those whose bytes are all there)."""

    shards: list[str]
    shard: list[int] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    where: list = field(default_factory=list)
    size: list[list[int]] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.key)

    def counts(self) -> list[int]:
        """Samples per shard, in shard order."""
        return np.bincount(np.asarray(self.shard, dtype=np.int64), minlength=len(self.shards)).tolist()


def list_shards(path: str | Path) -> list[Path]:
    """The ``.tar`` and ``.parquet`` files of the folder ``path`` (sorted by name), or ``path`` itself
    when it is one such file. ``DatasetError`` naming ``data.path`` when there is none or formats mix."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.suffix in (".tar", ".parquet")) if p.is_dir() else [p]
    if not files or not all(f.is_file() and f.suffix in (".tar", ".parquet") for f in files):
        raise DatasetError(f"data.path: '{path}' holds no .tar or .parquet shard")
    if len({f.suffix for f in files}) > 1:
        raise DatasetError(f"data.path: '{path}' mixes .tar and .parquet shards; keep one format per folder")
    return files


def _image_size(head: bytes) -> list[int]:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(head)) as im:
            return list(im.size)
    except Exception:  # a truncated or unknown header: the read decides
        return [0, 0]


def _index_tar(path: Path, shard: int, out: ShardIndex) -> None:
    """Append the samples of the tar ``path`` to ``out``. A tar that ends early (a header cut, or a
    member whose bytes run past the file's end) keeps the samples read whole before, recorded in
    ``out.truncated``."""
    total = path.stat().st_size
    members: dict[str, dict[str, list[int]]] = {}
    cut = False
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                name = info.name.rsplit("/", 1)
                stem, _, ext = name[-1].partition(".")
                key = (name[0] + "/" + stem) if len(name) == 2 else stem
                members.setdefault(key, {})[ext.lower()] = [info.offset_data, info.size]
            end = tar.offset  # where the end-of-archive marker (two zero blocks) must be
        with open(path, "rb") as f:
            f.seek(end)
            marker = f.read(1024)
        if marker != b"\0" * 1024:  # cut at or inside a header: tarfile stops without an error
            raise tarfile.ReadError("no end-of-archive marker")
    except (tarfile.TarError, OSError, EOFError) as e:
        log.warning("%s: tar ends early (%s); keeping the samples read whole before", path, e)
        cut = True
        if members:
            members.popitem()  # the last sample read may have lost members
    kept = 0
    with open(path, "rb") as f:
        for key, exts in members.items():
            if any(off + size > total for off, size in exts.values()):
                cut = True
                continue
            kept += 1
            image = next((e for e in IMAGE_EXTS if e in exts), None)
            head = b""
            if image:
                f.seek(exts[image][0])
                head = f.read(min(exts[image][1], HEADER_BYTES))
            out.shard.append(shard)
            out.key.append(key)
            out.where.append(exts)
            out.size.append(_image_size(head) if head else [0, 0])
    if cut:
        out.truncated[path.name] = kept


def _index_parquet(path: Path, shard: int, out: ShardIndex, columns: "ParquetColumns") -> None:
    pq = require("pyarrow.parquet", "data.source: shards (parquet)")

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a corrupt footer
        log.warning("%s: unreadable parquet (%s); skipping the shard", path, e)
        out.truncated[path.name] = 0
        return
    names = set(pf.schema_arrow.names)
    for col in (columns.image, columns.caption):
        if col not in names:
            raise DatasetError(f"{path}: no column '{col}' (columns: {sorted(names)}; set data.image_column / "
                               f"data.caption_column)")
    for g in range(pf.num_row_groups):
        want = [columns.image] + ([columns.key] if columns.key in names else [])
        try:
            table = pf.read_row_group(g, columns=want)
        except Exception as e:  # a corrupt row group: its samples are left out, the shard named
            log.warning("%s: row group %d unreadable (%s: %s); its samples are left out", path, g, type(e).__name__, e)
            out.truncated[path.name] = out.truncated.get(path.name, 0)
            continue
        images = table.column(columns.image).to_pylist()
        keys = table.column(columns.key).to_pylist() if columns.key in names else None
        for row, value in enumerate(images):
            raw = value.get("bytes") if isinstance(value, dict) else value
            out.shard.append(shard)
            out.key.append(str(keys[row]) if keys else f"{path.stem}/{g}/{row}")
            out.where.append([g, row])
            out.size.append(_image_size(raw[:HEADER_BYTES]) if isinstance(raw, bytes) else [0, 0])


@dataclass(frozen=True)
class ParquetColumns:
    """Column names of a parquet shard set: ``image`` (bytes or ``{"bytes": ...}``), ``caption``,
    ``key`` (optional; ``<file stem>/<row group>/<row>`` when absent)."""

    image: str = "image"
    caption: str = "caption"
    key: str = "key"


def build_index(files: list[Path], cache: Path, columns: ParquetColumns = ParquetColumns()) -> ShardIndex:
    """The :class:`ShardIndex` of ``files``, read from ``cache`` (a folder) when a file there matches their
    paths, sizes, modification times and the parquet columns, else built (tar headers and image headers
    only) and written there atomically."""
    stamp = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    digest = hashlib.sha256(json.dumps([INDEX_VERSION, stamp, list(vars(columns).values())]).encode()
                            ).hexdigest()[:16]
    path = cache / f"shard-index-{digest}.json"
    if path.is_file():
        try:
            return ShardIndex(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            log.warning("%s: unreadable shard index (%s); rebuilding it", path, e)
    out = ShardIndex(shards=[str(f) for f in files])
    from tqdm.auto import tqdm

    for i, f in enumerate(tqdm(files, desc="indexing shards", leave=False, disable=len(files) < 8)):
        if f.suffix == ".tar":
            _index_tar(f, i, out)
        else:
            _index_parquet(f, i, out, columns)
    if out.truncated:
        log.warning("shards: %d shard(s) end early, their whole samples kept: %s", len(out.truncated),
                    ", ".join(f"{k}: {v} kept" for k, v in out.truncated.items()))
    if not len(out):
        raise DatasetError(f"data.path: no sample in {len(files)} shard(s) (first: {files[0]})")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(vars(out)))
    os.replace(tmp, path)
    return out


class ShardReader:
    """Reads one sample's raw fields by index position: ``read(i) -> (bytes, caption, ext)``; raises
    :class:`BadSample`. Keeps up to ``OPEN_FILES`` shards open and ``ROW_GROUPS`` decoded parquet row
    groups, per process (opened lazily, so a DataLoader worker opens its own after the fork)."""

    def __init__(self, index: ShardIndex, columns: ParquetColumns = ParquetColumns()):
        self.index, self.columns = index, columns
        self._files: OrderedDict[int, object] = OrderedDict()  # at most OPEN_FILES open shards
        self._groups: OrderedDict[tuple[int, int], object] = OrderedDict()  # decoded parquet row groups
        self._pid = os.getpid()

    def __getstate__(self):
        return {"index": self.index, "columns": self.columns}

    def __setstate__(self, state):
        self.__init__(state["index"], state["columns"])

    def where(self, i: int) -> tuple[str, str]:
        """(shard file name, key) of sample ``i``."""
        return Path(self.index.shards[self.index.shard[i]]).name, self.index.key[i]

    def read(self, i: int) -> tuple[bytes, str, str]:
        """(image or video bytes, caption, the member's extension) of sample ``i``. :class:`BadSample`
        for the sample's own bytes (cut short, undecodable text, a caption member that is not what it
        should be); a shard that cannot be opened raises ``OSError`` (a storage problem, not a sample)."""
        if os.getpid() != self._pid:  # forked: never share a file offset with the parent
            self.__init__(self.index, self.columns)
        shard = self.index.shard[i]
        path = self.index.shards[shard]
        name, key = self.where(i)
        handle = self._handle(shard, path)
        try:
            if path.endswith(".tar"):
                image, caption, ext = self._read_tar(handle, self.index.where[i])
            else:
                (image, caption), ext = self._read_parquet(shard, handle, *self.index.where[i]), "image"
        except MemoryError:
            raise
        except Exception as e:  # pyarrow, json and codecs raise many types for a bad sample
            raise BadSample(name, key, f"unreadable bytes ({type(e).__name__}: {e})") from e
        if image is None:
            raise BadSample(name, key, "no image")
        if not caption:
            raise BadSample(name, key, "missing caption")
        return image, caption, ext

    def _handle(self, shard: int, path: str):
        """The open file (tar) or ``ParquetFile`` of ``shard``, kept in a small LRU."""
        handle = self._files.pop(shard, None)
        if handle is None:
            if path.endswith(".tar"):
                handle = open(path, "rb")
            else:
                handle = require("pyarrow.parquet", "data.source: shards (parquet)").ParquetFile(path)
            while len(self._files) >= OPEN_FILES:
                _, old = self._files.popitem(last=False)
                getattr(old, "close", lambda: None)()
        self._files[shard] = handle
        return handle

    @staticmethod
    def _read_tar(f, exts: dict) -> tuple[bytes | None, str, str | None]:
        def member(ext: str) -> bytes:
            off, size = exts[ext]
            f.seek(off)
            data = f.read(size)
            if len(data) != size:
                raise OSError(f"{ext} member cut short")
            return data

        ext = next((e for e in (*IMAGE_EXTS, *VIDEO_EXTS) if e in exts), None)
        image = member(ext) if ext else None
        caption = ""
        for cap in CAPTION_EXTS:
            if cap in exts:
                text = member(cap).decode("utf-8", errors="replace")
                if cap == "json":
                    meta = json.loads(text)
                    caption = str(meta.get("caption") or "") if isinstance(meta, dict) else ""
                else:
                    caption = text
                break
        return image, caption.strip(), ext

    def _read_parquet(self, shard: int, pf, group: int, row: int) -> tuple[bytes | None, str]:
        table = self._groups.pop((shard, group), None)
        if table is None:
            table = pf.read_row_group(group, columns=[self.columns.image, self.columns.caption])
            while len(self._groups) >= ROW_GROUPS:
                self._groups.popitem(last=False)
        self._groups[(shard, group)] = table
        value = table.column(self.columns.image)[row].as_py()
        image = value.get("bytes") if isinstance(value, dict) else value
        caption = table.column(self.columns.caption)[row].as_py()
        return image, str(caption or "").strip()


def decode_image(data: bytes, height: int, width: int, max_pixels: int, where: tuple[str, str]) -> np.ndarray:
    """uint8 ``[height, width, 3]``: the image composited on white, scaled so that it covers
    ``height`` x ``width`` and centre-cropped. :class:`BadSample` ("corrupt image", or "image too large"
    when the header claims more than ``max_pixels`` pixels, checked before any pixel is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.size[0] * im.size[1] > max_pixels:
                raise BadSample(*where, f"image too large ({im.size[0]}x{im.size[1]} > {max_pixels} pixels)")
            im.load()
            rgba = im.convert("RGBA")
    except BadSample:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own limit, met before ours at twice its default
        raise BadSample(*where, f"image too large ({e})") from e
    except Exception as e:  # Pillow raises many types for corrupt data
        raise BadSample(*where, f"corrupt image ({type(e).__name__})") from e
    return cover_crop(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"),
                      height, width)


def cover_crop(rgb, height: int, width: int) -> np.ndarray:
    """uint8 ``[height, width, 3]``: the centre of the PIL image ``rgb`` with the aspect ratio of
    ``height`` x ``width``, resized to it (bicubic): the image scaled to cover, then centre-cropped. The
    crop is taken in the source's coordinates, so an extreme aspect ratio costs no huge resize."""
    from PIL import Image

    scale = max(width / rgb.width, height / rgb.height)
    w, h = width / scale, height / scale  # the crop, in source pixels
    left, top = (rgb.width - w) / 2, (rgb.height - h) / 2
    return np.asarray(rgb.resize((width, height), Image.BICUBIC, box=(left, top, left + w, top + h)))


def decode_video(data: bytes, ext: str, clip: "ClipSampling", height: int, width: int,
                 where: tuple[str, str]) -> np.ndarray:
    """uint8 ``[clip.frames, height, width, 3]``: ``clip.frames`` frames ``stride`` apart (``stride``:
    ``clip.stride``, or round(source fps / ``clip.fps``) when ``clip.fps`` is set), the window centred in
    the clip, each frame scaled to cover ``height`` x ``width`` and centre-cropped. :class:`BadSample`
    ("corrupt video", "clip too short", "video too large": more than ``max_pixels`` per frame, "video too
    long": no duration and over ``MAX_FRAMES`` frames). Only the kept frames are held in memory; the clip's
    length comes from its duration x fps (counted by decoding when the container has no duration)."""
    from PIL import Image

    iio = require("imageio.v3", "video clips in shards")
    try:
        meta = iio.immeta(data, extension=f".{ext}", plugin="FFMPEG")
        w, h = meta.get("size") or (0, 0)
        if w * h > clip.max_pixels:
            raise BadSample(*where, f"video too large ({w}x{h} > {clip.max_pixels} pixels per frame)")
        source_fps = float(meta.get("fps") or 0)
        source_fps = source_fps if math.isfinite(source_fps) and source_fps > 0 else float(clip.fps or 1)
        stride = clip.stride if not clip.fps else max(1, round(source_fps / clip.fps))
        need = (clip.frames - 1) * stride + 1
        duration = float(meta.get("duration") or 0)
        count = round(duration * source_fps) if math.isfinite(duration) and duration > 0 else None
        if count is None:  # no duration in the container: count the frames (decoded, none kept)
            count = 0
            for _ in iio.imiter(data, extension=f".{ext}", plugin="FFMPEG"):
                count += 1
                if count > MAX_FRAMES:
                    raise BadSample(*where, f"video too long (over {MAX_FRAMES} frames without a duration)")
        if count < need:
            raise BadSample(*where, f"clip too short ({count} frames, {clip.frames} at stride {stride} need {need})")
        start, picked = (count - need) // 2, []
        for n, frame in enumerate(iio.imiter(data, extension=f".{ext}", plugin="FFMPEG")):
            if n >= start and (n - start) % stride == 0:  # only the frames kept are converted
                picked.append(cover_crop(Image.fromarray(frame).convert("RGB"), height, width))
                if len(picked) == clip.frames:
                    break
    except (BadSample, MemoryError):
        raise
    except Exception as e:  # ffmpeg's errors come as several types
        raise BadSample(*where, f"corrupt video ({type(e).__name__})") from e
    if len(picked) < clip.frames:  # the container's duration promised more frames than it holds
        raise BadSample(*where, f"clip too short (decoded {start + (len(picked) - 1) * stride + 1 if picked else 0} "
                                f"frames, {clip.frames} at stride {stride} from frame {start})")
    return np.stack(picked)


@dataclass(frozen=True)
class ClipSampling:
    """How a video sample becomes ``frames`` frames: every ``stride``-th frame, or the stride that gives
    ``fps`` frames per second when ``fps`` is set; ``max_pixels`` per frame."""

    frames: int = 8
    stride: int = 1
    fps: float | None = None
    max_pixels: int = 89_478_485


def write_tar_shards(samples, folder: str | Path, per_shard: int, prefix: str = "shard") -> list[Path]:
    """Write ``samples`` (an iterable of ``(key, png bytes, caption)``, ``(key, bytes, caption, meta)`` or
    ``(key, bytes, caption, meta, ext)``: ``meta`` a JSON-able dict stored as the ``json`` member or None,
    ``ext`` the data member's extension, "png" by default, e.g. "mp4") as WebDataset tar shards of
    ``per_shard`` samples each (``webdataset.ShardWriter``): ``<folder>/<prefix>-000000.tar``, ...;
    returns their paths."""
    wds = require("webdataset", "writing tar shards")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pattern = str(folder / f"{prefix}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for key, data, caption, *rest in samples:
            meta, ext = (rest + [None, "png"][len(rest):])[:2]
            extra = {"json": json.dumps(meta, ensure_ascii=False).encode()} if meta else {}
            sink.write({"__key__": key, ext: data, "txt": caption, **extra})
    return sorted(folder.glob(f"{prefix}-*.tar"))
