"""A tiny PNG whose header claims 20000 x 20000 pixels (a decompression bomb: Pillow refuses it with
``DecompressionBombError``, not an ``OSError``) is skipped and counted like any corrupt image by every
image reader: folder data (and so curate, which reads through it), DPO pairs and base64 images."""

import base64
import io
import json
import struct
import zlib

import pytest
from PIL import Image

from posttrain.dpo.data import load_preference_pairs
from pretrain.data.folder import load_image_folder
from rewards.png import decode_png_b64

pytestmark = pytest.mark.core


def bomb_png(side: int = 20000) -> bytes:
    """A PNG of a few dozen bytes whose IHDR says ``side`` x ``side`` RGB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _png(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def test_the_bomb_is_one_pillow_refuses_outside_its_oserror():
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(bomb_png()))
    assert not issubclass(Image.DecompressionBombError, (OSError, ValueError))  # why each reader names it


def test_folder_dataset_skips_and_counts_a_bomb(tmp_path, caplog):
    (tmp_path / "ok.png").write_bytes(_png("red"))
    (tmp_path / "bomb.png").write_bytes(bomb_png())
    rows = [{"file": "bomb.png", "caption": "huge"}, {"file": "ok.png", "caption": "a red square"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_image_folder(tmp_path, 8)
    images, captions, skipped = got.images, got.captions, got.skipped
    assert captions == ["a red square"] and images.shape == (1, 3, 8, 8)
    assert skipped == {"corrupt image": ["bomb.png"]}
    assert "1 corrupt image (first: bomb.png)" in caplog.text


def test_dpo_pairs_skip_a_bomb(tmp_path):
    rows = [{"caption": "bomb", "jpg_0": "bomb.png", "jpg_1": "a.png", "label_0": 1},
            {"caption": "fine", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0}]
    (tmp_path / "a.png").write_bytes(_png("red"))
    (tmp_path / "b.png").write_bytes(_png("blue"))
    (tmp_path / "bomb.png").write_bytes(bomb_png())
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    winners, _, captions, _, skipped = load_preference_pairs(tmp_path, 8)
    assert captions == ["fine"] and skipped == {"missing or unreadable image": ["row 0"]}
    assert winners[0, 2].float().mean() > 250  # label_0 = 0: b.png (blue) wins


def test_base64_image_reader_names_the_sample():
    with pytest.raises(ValueError, match=r"^images\[3\]: not a base64-encoded PNG \(Image size \(400000000 pixels\)"):
        decode_png_b64(base64.b64encode(bomb_png()).decode(), "images[3]")
