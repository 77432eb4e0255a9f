"""JPEG compressibility / incompressibility (DDPO, Black et al. 2023, arXiv 2305.13301, sec. 6.1):
the size of the image encoded as JPEG at quality 95, in kB (1000 bytes); compressibility is its
negation, so smaller files score higher."""

from __future__ import annotations

import io

import torch

from rewards.base import register
from rewards.images import to_pil


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """float32 ``[B]``: JPEG size in kB of each image (float ``[B, 3, H, W]`` in [0, 1])."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"jpeg reward expects images [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
    sizes = []
    for img in to_pil(images):
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register("jpeg_compressibility")
class JpegCompressibility:
    """Reward = -(JPEG size in kB at quality 95)."""

    def __init__(self, quality: int = 95):
        self.quality = quality

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        return -jpeg_size_kb(images, self.quality)


@register("jpeg_incompressibility")
class JpegIncompressibility:
    """Reward = +(JPEG size in kB at quality 95)."""

    def __init__(self, quality: int = 95):
        self.quality = quality

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        return jpeg_size_kb(images, self.quality)
