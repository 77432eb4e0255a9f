"""``motion_displacement``: a smooth motion reward for training, the signed displacement of the sprite
along the direction its prompt names.

``motion_direction`` is a 0/1 score of hard sprite masks, and ``motion_alignment`` subtracts the motion
across the named axis, which makes a still clip the safe answer. Policy-gradient estimates are the
covariance of the reward with the sampling noise, so a reward that is a smooth, nearly linear function
of the pixels gives the most signal per sample (a thresholded one throws most of it away). Here every
pixel weighs its distance d from the background (max over RGB of |pixel - border median|, in [0, 1])
less a floor, max(d - floor, 0) (default 0.1: the faint noise an SDE sample leaves on the canvas would
otherwise carry half the weight and pull every centroid to the middle); per frame the weighted
centroid (y, x in frame units) and the weighted area (share of the frame) are taken, and a
least-squares line through all F frames gives the change over the clip:

- left / right / up / down: the centroid's change along the named axis in the named sense (frame
  units; the real clips of ``pretrain/data/moving_emoji.py`` move about 0.375);
- growing / shrinking: the change of the linear size sqrt(area) in the named sense (frame units; a
  real clip, half to full size, about 0.13).

float32 ``[B]``, clamped to [-1, 1]; NaN when the prompt names no direction, or when some frame of the
video has no pixel above the floor (no sprite to track there; GRPO masks such samples out). Nothing
across the axis is penalised: a still clip scores 0, as does one moving across, and the opposite
motion scores below both.
"""

from __future__ import annotations

import torch

from rewards.base import register
from rewards.motion import DIRECTIONS, background_distance, named_direction, track
from rewards.video_checks import check_video


def soft_tracks(videos: torch.Tensor, floor: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted centroids float32 ``[B, F, 2]`` (y, x in frame units; NaN for an empty frame) and
    weighted areas ``[B, F]`` of videos ``[B, F, 3, H, W]`` in [0, 1]; weights max(d - ``floor``, 0)."""
    return track((background_distance(videos.float()) - floor).clamp(min=0))


def clip_change(series: torch.Tensor) -> torch.Tensor:
    """Change over the clip of ``series`` ``[B, F, ...]``: the least-squares slope per frame x (F - 1)."""
    f = series.shape[1]
    t = torch.arange(f, dtype=torch.float32) - (f - 1) / 2
    t = t.reshape((1, f) + (1,) * (series.ndim - 2))
    return (series * t).sum(1) / t.square().sum() * (f - 1)


@register("motion_displacement")
class MotionDisplacement:
    """Smooth signed motion along the prompt's direction (see the module docstring), float32 ``[B]``
    in [-1, 1], NaN where the prompt names no direction. Input: videos float ``[B, F, 3, H, W]`` in
    [0, 1] with F >= 2, ``B`` prompts. Parameter: ``floor`` (default 0.1, [0, 1] units). ``ValueError``
    for a tensor that is not a batch of videos or a prompt count that does not match."""

    name = "motion_displacement"

    def __init__(self, floor: float = 0.1):
        self.floor = float(floor)

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        videos = check_video(images, self.name).cpu()
        b = videos.shape[0]
        prompts = list(prompts or [""] * b)
        if len(prompts) != b:
            raise ValueError(f"{self.name}: {b} videos but {len(prompts)} prompts")
        centroid, area = soft_tracks(videos, self.floor)
        shift = clip_change(centroid)  # [B, 2]
        growth = clip_change(area.sqrt()).masked_fill((area <= 0).any(1), float("nan"))  # [B]
        out = torch.full((b,), float("nan"))
        for i, prompt in enumerate(prompts):
            direction = named_direction(prompt)
            if direction is None:
                continue
            axis, sense = DIRECTIONS[direction]
            out[i] = sense * (growth[i] if axis == 2 else shift[i, axis])
        return out.clamp(-1.0, 1.0)
