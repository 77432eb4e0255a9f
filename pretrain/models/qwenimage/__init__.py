"""Qwen-Image (``QwenImageTransformer2DModel``): ``QwenImagePipeline`` folders and their adapter
(``pipeline.py``). No presets, no sequence- or tensor-parallel plan."""

from pretrain.models.qwenimage.pipeline import PIPELINE, QwenImageAdapter, QwenImageCodec, QwenImagePromptEncoder, load

__all__ = ["PIPELINE", "QwenImageAdapter", "QwenImageCodec", "QwenImagePromptEncoder", "load"]
