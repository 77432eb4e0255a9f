"""Qwen-Image (``QwenImageTransformer2DModel``): ``QwenImagePipeline`` folders and their adapter
(``pipeline.py``), ``QwenImageEditPipeline`` folders (``edit.py``), both loaded by ``loader.py``. No
presets; tensor- and context-parallel plans, no sequence-parallel one."""

from pretrain.models.qwenimage.loader import load
from pretrain.models.qwenimage.pipeline import (PIPELINE, PIPELINES, QwenImageAdapter, QwenImageCodec,
                                                QwenImagePromptEncoder)

__all__ = ["PIPELINE", "PIPELINES", "QwenImageAdapter", "QwenImageCodec", "QwenImagePromptEncoder", "load"]
