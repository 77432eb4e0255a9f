"""Animated sample grids of videos: a GIF and an MP4 (imageio, with the ffmpeg binary that
``imageio-ffmpeg`` bundles), each frame the labelled grid of every clip's frame f."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pretrain.grid import grid_image


def save_animation(videos: torch.Tensor, captions: list[str], stem: str | Path, cols: int = 8, scale: int = 3,
                   fps: int = 4, span: int = 1) -> list[Path]:
    """Write videos float ``[N, F, 3, H, W]`` in [0, 1] to ``<stem>.gif`` and ``<stem>.mp4`` (H.264,
    ``fps`` frames per second; the frame is padded with white to even sides, as yuv420p needs), one caption
    per ``span`` clips (:func:`pretrain.grid.grid_image`). Returns the two paths. ``ValueError`` for a
    tensor that is not a batch of videos."""
    from pretrain.extras import require

    imageio = require("imageio.v2", "writing video samples (GIF / MP4)")

    if videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"save_animation: videos [N, F, 3, H, W] expected, got {tuple(videos.shape)}")
    frames = [np.asarray(grid_image(videos[:, f], captions, cols, scale, span=span)) for f in range(videos.shape[1])]
    h, w = frames[0].shape[:2]
    pad = ((0, h % 2), (0, w % 2), (0, 0))
    frames = [np.pad(f, pad, constant_values=255) for f in frames]
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    gif, mp4 = stem.with_suffix(".gif"), stem.with_suffix(".mp4")
    imageio.mimsave(gif, frames, duration=1000 / fps, loop=0)
    imageio.mimsave(mp4, frames, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1)
    return [gif, mp4]
