"""Z-Image (``ZImageTransformer2DModel``): ``ZImagePipeline`` folders and their adapter (``pipeline.py``).
No presets, no sequence- or tensor-parallel plan."""

from pretrain.models.zimage.pipeline import PIPELINE, ZImageAdapter, ZImagePromptEncoder, load

__all__ = ["PIPELINE", "ZImageAdapter", "ZImagePromptEncoder", "load"]
