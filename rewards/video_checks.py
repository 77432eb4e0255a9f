"""Shape check shared by the video rewards: videos are float ``[B, F, 3, H, W]`` in [0, 1]."""

from __future__ import annotations

import torch


def check_video(videos: torch.Tensor, reward: str) -> torch.Tensor:
    """``videos`` as float32; ``ValueError`` naming ``reward`` and the shape unless ``[B, F, 3, H, W]``
    with F >= 2."""
    if videos.ndim != 5 or videos.shape[2] != 3 or videos.shape[1] < 2:
        raise ValueError(f"{reward} reward expects videos [B, F >= 2, 3, H, W] in [0, 1], "
                         f"got shape {tuple(videos.shape)}")
    return videos.float()
