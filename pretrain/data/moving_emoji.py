"""The "moving emoji" video set: an OpenMoji sprite on a plain white canvas that moves left / right /
up / down, grows or shrinks across F frames, captioned e.g. "red apple moving left" or "red apple
growing". Deterministic (no randomness: the motion of each emoji comes from a hash of its name), and
held out by base emoji like the image set.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

MOTIONS = ("left", "right", "up", "down", "growing", "shrinking")


def motion_caption(name: str, motion: str) -> str:
    """``"<name> moving <motion>"`` for a direction, ``"<name> <motion>"`` for growing / shrinking."""
    return f"{name} moving {motion}" if motion in MOTIONS[:4] else f"{name} {motion}"


def motion_for(key: str, k: int = 0) -> str:
    """The ``k``-th motion of the emoji ``key``: a hash picks a start, then the list is walked."""
    h = int.from_bytes(hashlib.sha256(f"motion:{key}".encode()).digest()[:4], "big")
    return MOTIONS[(h + k) % len(MOTIONS)]


def make_clip(sprite: torch.Tensor, motion: str, frames: int, size: int) -> torch.Tensor:
    """uint8 ``[frames, 3, size, size]``: ``sprite`` (uint8 ``[3, s, s]`` on white, s <= size) on a
    white canvas. Directions move the sprite's top-left corner linearly from one side to the other
    (1/8 of the free space from each edge), centred across; growing / shrinking scale it between half
    and full size about the canvas centre. ``ValueError`` for an unknown motion, a sprite larger than
    the canvas or fewer than 2 frames."""
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion '{motion}' (known: {MOTIONS})")
    s = sprite.shape[-1]
    if s > size or frames < 2:
        raise ValueError(f"make_clip: sprite {s} px on a {size} px canvas with {frames} frames")
    out = torch.full((frames, 3, size, size), 255, dtype=torch.uint8)
    free = size - s
    lo, hi, mid = free // 8, free - free // 8, free // 2
    for f in range(frames):
        t = f / (frames - 1)
        if motion in ("growing", "shrinking"):
            scale = 0.5 + 0.5 * (t if motion == "growing" else 1 - t)
            k = max(2, round(s * scale))
            img = F.interpolate(sprite[None].float(), size=(k, k), mode="bilinear", antialias=True,
                                align_corners=False)[0].round().clamp(0, 255).to(torch.uint8)
            y = x = (size - k) // 2
        else:
            img, k = sprite, s
            pos = round(lo + (hi - lo) * (t if motion in ("right", "down") else 1 - t))
            y, x = (mid, pos) if motion in ("left", "right") else (pos, mid)
        out[f, :, y:y + k, x:x + k] = img
    return out


def build_clips(texts: list[str], names: list[str], keys: list[str], frames: int, size: int,
                motions_per_emoji: int = 1) -> tuple[torch.Tensor, list[str], list[str]]:
    """Clips for each emoji (``texts`` to render, caption ``names``, hash ``keys``): sprites rendered at
    ``size // 2`` px, ``motions_per_emoji`` motions each (:func:`motion_for`). Returns (uint8
    ``[N, frames, 3, size, size]``, captions, the key of each clip)."""
    from pretrain.data.emoji import render_emoji

    sprites = render_emoji(texts, max(4, size // 2))
    clips, captions, clip_keys = [], [], []
    for sprite, name, key in zip(sprites, names, keys):
        for k in range(min(motions_per_emoji, len(MOTIONS))):
            motion = motion_for(key, k)
            clips.append(make_clip(sprite, motion, frames, size))
            captions.append(motion_caption(name, motion))
            clip_keys.append(key)
    return torch.stack(clips), captions, clip_keys
