"""Qwen-Image (``QwenImageTransformer2DModel``): ``QwenImagePipeline`` folders and their adapter
(``pipeline.py``). No presets; tensor- and context-parallel plans, no sequence-parallel one."""

from pretrain.models.qwenimage.pipeline import PIPELINE, QwenImageAdapter, QwenImageCodec, QwenImagePromptEncoder, load

__all__ = ["PIPELINE", "QwenImageAdapter", "QwenImageCodec", "QwenImagePromptEncoder", "load"]
