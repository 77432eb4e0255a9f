"""Test-sized shard sets: OpenMoji renders written as WebDataset tar or parquet shards, and hostile
variants (a truncated tar, a corrupt image, a missing caption, a huge image header)."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from pretrain.data.builtin import load_openmoji
from pretrain.data.dataset import DataConfig
from pretrain.data.shards import write_tar_shards


def png(array: np.ndarray) -> bytes:
    """PNG bytes of a uint8 ``[H, W, 3]`` array."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def emoji_samples(n: int, size: int = 16, width: int | None = None):
    """``n`` (key, png bytes, caption) of OpenMoji renders (cycled), keys ``s000000``...; ``width``:
    stretch to that width (an aspect ratio other than square)."""
    raw = load_openmoji(DataConfig(size=size))
    images = raw["images"].permute(0, 2, 3, 1).numpy()
    for i in range(n):
        j = i % len(images)
        image = images[j]
        if width:
            image = np.asarray(Image.fromarray(image).resize((width, size)))
        yield f"s{i:06d}", png(image), raw["captions"][j]


def tar_set(folder: Path, n: int = 2000, per_shard: int = 100, size: int = 16) -> list[Path]:
    """``n`` emoji samples in tar shards of ``per_shard``."""
    return write_tar_shards(emoji_samples(n, size), folder, per_shard)


def parquet_set(folder: Path, n: int = 600, per_shard: int = 200, size: int = 16) -> list[Path]:
    """``n`` emoji samples in parquet shards (columns key, image as ``{"bytes": ...}``, caption), row
    groups of 50."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = list(emoji_samples(n, size))
    paths = []
    for s in range(0, n, per_shard):
        chunk = rows[s:s + per_shard]
        table = pa.table({"key": [k for k, _, _ in chunk], "image": [{"bytes": b} for _, b, _ in chunk],
                          "caption": [c for _, _, c in chunk]})
        paths.append(folder / f"part-{s // per_shard:05d}.parquet")
        pq.write_table(table, paths[-1], row_group_size=50)
    return paths


def huge_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid-looking PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's
    header; its data is one row)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 4))
            + chunk(b"IEND", b""))


def hostile_set(folder: Path, n: int = 400, per_shard: int = 50) -> dict[str, str]:
    """Tar shards of ``n`` emoji samples where, in shard 1, ``s000060`` has a corrupt image,
    ``s000061`` no caption, ``s000062`` a huge header, ``s000063`` no image at all, and the last shard
    is cut in the middle of a member. Returns {key: expected reason} of the bad samples read (the cut
    shard's lost samples are counted at indexing, not read)."""
    bad = {"s000060": "corrupt image", "s000061": "missing caption", "s000062": "image too large",
           "s000063": "no image"}

    def samples():
        for key, data, caption in emoji_samples(n):
            if key == "s000060":
                data = data[:40] + b"\x00" * 30
            elif key == "s000061":
                caption = "   "
            elif key == "s000062":
                data = huge_png()
            elif key == "s000063":
                yield key, None, caption
                continue
            yield key, data, caption

    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for key, data, caption in samples():
            sink.write({"__key__": key, "txt": caption, **({"png": data} if data is not None else {})})
    last = sorted(folder.glob("*.tar"))[-1]
    raw = last.read_bytes()
    last.write_bytes(raw[: len(raw) // 2 + 100])  # cut inside a member
    return bad


def record_keys(run) -> list[list[str]]:
    """Wrap ``run.feed.next`` (a pretraining or midtraining run) to record each micro-batch share's sample
    keys; returns the list it appends to."""
    keys, feed_next = [], run.feed.next

    def record():
        fed = feed_next()
        keys.append(fed.keys)
        return fed

    run.feed.next = record
    return keys


def mp4(frames: np.ndarray, fps: float = 10.0) -> bytes:
    """MP4 (H.264) bytes of uint8 frames ``[F, H, W, 3]`` (imageio's ffmpeg plugin)."""
    import imageio.v3 as iio

    return iio.imwrite("<bytes>", frames, extension=".mp4", plugin="FFMPEG", fps=fps, macro_block_size=1)


def video_set(folder: Path, n: int = 96, per_shard: int = 24, size: int = 16, frames: int = 8) -> list[Path]:
    """``n`` moving-emoji clips (``frames`` frames at ``size`` px, 10 fps) as mp4 members of tar shards."""
    import webdataset as wds

    from pretrain.data.builtin import load_moving_emoji

    raw = load_moving_emoji(DataConfig(source="moving_emoji", size=size, frames=frames))
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "clips-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            j = i % len(raw["captions"])
            clip = raw["images"][j].permute(0, 2, 3, 1).numpy()
            sink.write({"__key__": f"c{i:05d}", "mp4": mp4(clip), "txt": raw["captions"][j]})
    return sorted(folder.glob("*.tar"))
