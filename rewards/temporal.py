"""Video rewards over frames: ``temporal_consistency`` (frame-to-frame similarity) and ``per_frame``
(any image reward applied to every frame, averaged)."""

from __future__ import annotations

import torch

from rewards.base import build_reward, register
from rewards.video_checks import check_video


@register("temporal_consistency")
def temporal_consistency(images, prompts=None, metadata=None) -> torch.Tensor:
    """float32 ``[B]`` in [0, 1]: 1 - mean absolute difference between consecutive frames of videos
    ``[B, F, 3, H, W]`` in [0, 1] (1: a still video; flicker and jumps lower it)."""
    videos = check_video(images, "temporal_consistency")
    return 1.0 - (videos[:, 1:] - videos[:, :-1]).abs().mean(dim=(1, 2, 3, 4))


@register("per_frame")
class PerFrame:
    """Applies the image reward ``reward`` (a registered name or ``pkg.module:attr``, built with
    ``params``) to every frame of videos ``[B, F, 3, H, W]`` (each frame with its video's prompt) and
    returns the NaN-aware mean over frames, float32 ``[B]`` (NaN only if every frame is NaN).
    ``every``: score every k-th frame (1 = all)."""

    def __init__(self, reward: str, params: dict | None = None, every: int = 1):
        if every < 1:
            raise ValueError(f"per_frame.every: must be >= 1, got {every}")
        self.name, self.every = reward, every
        self.reward = build_reward(reward, **dict(params or {}))

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        videos = check_video(images, "per_frame")[:, :: self.every]
        b, f = videos.shape[:2]
        frame_prompts = None if prompts is None else [p for p in prompts for _ in range(f)]
        scores = torch.as_tensor(self.reward(videos.flatten(0, 1), frame_prompts, metadata), dtype=torch.float32)
        if scores.shape != (b * f,):
            raise ValueError(f"per_frame: reward '{self.name}' returned shape {tuple(scores.shape)} for "
                             f"{b * f} frames")
        return scores.view(b, f).nanmean(dim=1)
