"""PNG <-> base64 for rewards that score over HTTP (``remote``, ``served``, ``posttrain serve-reward``).

Images travel as 8-bit RGB PNG: a float image in [0, 1] is quantised once, by
``round(clamp(x, 0, 1) * 255)``, so a reward scored over HTTP sees exactly ``quantise(images)``;
PNG itself is lossless.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import torch

from rewards.images import to_uint8


def quantise(images: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, 3, H, W]`` in [0, 1] -> the same images on the uint8 grid (float32, values k/255).
    This is what a reward behind HTTP receives; compare in-process scores against it."""
    return to_uint8(images).float() / 255.0


def encode_png_b64(images: torch.Tensor) -> list[str]:
    """float ``[B, 3, H, W]`` in [0, 1] -> ``B`` base64 strings of RGB PNG files (no data-URL prefix)."""
    from PIL import Image

    out = []
    for a in to_uint8(images).permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(a)).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def b64_bytes(data, where: str = "image") -> bytes:
    """The bytes of a base64 string (a ``data:...;base64,`` prefix is accepted). ``ValueError`` naming
    ``where`` when ``data`` is not a string or not valid base64."""
    if not isinstance(data, str):
        raise ValueError(f"{where}: expected a base64 string, got {type(data).__name__}")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}: not a base64-encoded PNG ({e})") from e


def decode_png_b64(data: str, where: str = "image") -> torch.Tensor:
    """A base64 PNG (or any image Pillow reads; a ``data:...;base64,`` prefix is accepted) ->
    float32 ``[3, H, W]`` in [0, 1] (converted to RGB). ``ValueError`` naming ``where`` when ``data``
    is not a string, not base64, or not a readable image."""
    from PIL import Image, UnidentifiedImageError

    raw = b64_bytes(data, where)
    try:
        with Image.open(io.BytesIO(raw)) as im:
            arr = np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a base64-encoded PNG ({e})") from e
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0
