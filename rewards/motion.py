"""``motion_direction``: does the sprite in a video move the way its prompt says?

The prompt names a direction ("... moving left|right|up|down", "... growing|shrinking"; the last such
word counts); a prompt naming none gives NaN. The sprite is every pixel farther than
``color_threshold`` (max over RGB, [0, 1] units) from the background colour, taken per frame as the
median of the frame's border pixels (a plain canvas). Its centroid is tracked from the first to the
last frame, in units of the frame size (x to the right, y downwards, so "up" is a negative y shift);
growing/shrinking compares the sprite's area. Score 1 when the displacement along the named axis is
at least ``min_shift`` in the named sense and larger than the displacement across it (for growth: the
area changes by a factor of at least ``1 + min_growth`` the named way), else 0; a frame without sprite
pixels scores 0.
"""

from __future__ import annotations

import math
import re

import torch

from rewards.base import register
from rewards.video_checks import check_video

DIRECTIONS = {"left": (1, -1), "right": (1, 1), "up": (0, -1), "down": (0, 1),  # (axis of (y, x), sense)
              "growing": (2, 1), "shrinking": (2, -1)}
_PATTERN = re.compile(r"\b(" + "|".join(DIRECTIONS) + r")\b", re.IGNORECASE)


def named_direction(prompt: str) -> str | None:
    """The last direction word of ``prompt`` (lower case), or None."""
    found = _PATTERN.findall(prompt or "")
    return found[-1].lower() if found else None


def background_distance(videos: torch.Tensor) -> torch.Tensor:
    """float ``[B, F, H, W]`` in [0, 1]: each pixel's distance (max over RGB) from its frame's border
    median, the plain canvas's colour."""
    border = torch.cat([videos[..., 0, :], videos[..., -1, :], videos[..., :, 0], videos[..., :, -1]], dim=-1)
    background = border.median(dim=-1).values  # [B, F, 3]
    return (videos - background[..., None, None]).abs().amax(dim=2)


def sprite_masks(videos: torch.Tensor, color_threshold: float) -> torch.Tensor:
    """bool ``[B, F, H, W]``: pixels farther than ``color_threshold`` from their frame's border median."""
    return background_distance(videos) > color_threshold


def track(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids float32 ``[B, F, 2]`` (y, x in units of the frame size; NaN where a frame has no sprite)
    and areas ``[B, F]`` (share of the frame) of ``masks`` ``[B, F, H, W]``: bool, or float weights
    (a weighted centroid and a weighted area)."""
    _, _, h, w = masks.shape
    m = masks.float()
    area = m.sum(dim=(-2, -1))
    ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h
    xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w
    cy = (m.sum(-1) * ys).sum(-1) / area
    cx = (m.sum(-2) * xs).sum(-1) / area
    return torch.stack([cy, cx], dim=-1), area / (h * w)


@register("motion_direction")
class MotionDirection:
    """Reward in {0, 1} (NaN: the prompt names no direction) for videos float ``[B, F, 3, H, W]`` in
    [0, 1] and their prompts. Parameters: ``min_shift`` (share of the frame, default 0.1),
    ``min_growth`` (relative area change, default 0.25), ``color_threshold`` (default 0.1).
    ``ValueError`` for a tensor that is not a batch of videos."""

    def __init__(self, min_shift: float = 0.1, min_growth: float = 0.25, color_threshold: float = 0.1):
        self.min_shift, self.min_growth, self.color_threshold = min_shift, min_growth, color_threshold

    name = "motion_direction"

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        videos = check_video(images, self.name)
        b = videos.shape[0]
        prompts = list(prompts or [""] * b)
        if len(prompts) != b:
            raise ValueError(f"{self.name}: {b} videos but {len(prompts)} prompts")
        centroid, area = track(sprite_masks(videos.cpu(), self.color_threshold))
        out = torch.full((b,), float("nan"))
        for i, prompt in enumerate(prompts):
            direction = named_direction(prompt)
            if direction is not None:
                axis, sense = DIRECTIONS[direction]
                a0, a1 = float(area[i, 0]), float(area[i, -1])
                d = centroid[i, -1] - centroid[i, 0]  # (dy, dx); NaN if the sprite vanished
                out[i] = self.score(axis, sense, a0, a1, d)
        return out

    def score(self, axis: int, sense: int, a0: float, a1: float, d: torch.Tensor) -> float:
        """1.0 or 0.0 for one video: first / last sprite areas ``a0``, ``a1``, centroid shift ``d``."""
        if axis == 2:
            return float(a0 > 0 and a1 > 0 and (a1 / a0 if sense > 0 else a0 / a1) >= 1 + self.min_growth)
        along, across = float(d[axis]) * sense, abs(float(d[1 - axis]))
        return float(along >= self.min_shift and along > across)  # False for NaN


@register("motion_alignment")
class MotionAlignment(MotionDirection):
    """A graded form of ``motion_direction`` for training (its binary score gives a group of GRPO
    samples little to rank): float32 ``[B]`` in [-1, 1], NaN when the prompt names no direction.
    Directions: the sprite centroid's displacement along the named direction minus the absolute
    displacement across it, first to last frame, in frame units. Growing / shrinking: log(area ratio)
    in the named sense over log 4 (half to full size). A video whose sprite vanishes scores -1.
    Same parameters as ``motion_direction`` (``color_threshold`` is used)."""

    name = "motion_alignment"

    def score(self, axis: int, sense: int, a0: float, a1: float, d: torch.Tensor) -> float:
        """The graded score in [-1, 1] of one video (see the class docstring)."""
        if axis == 2:
            value = sense * math.log(a1 / a0) / math.log(4) if a0 > 0 and a1 > 0 else -1.0
        else:
            value = float(d[axis]) * sense - abs(float(d[1 - axis]))
            value = -1.0 if math.isnan(value) else value
        return max(-1.0, min(1.0, value))
