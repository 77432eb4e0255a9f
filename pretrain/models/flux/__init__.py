"""FLUX.1 (``FluxTransformer2DModel``): ``FluxPipeline`` and ``FluxKontextPipeline`` folders and their
adapter (``pipeline.py``), and pixel-space presets for CPU pretraining (``model.py``). No sequence-parallel
plan."""

from pretrain.models.flux.model import FLUX_PRESETS, FluxPresetAdapter, build
from pretrain.models.flux.pipeline import PIPELINES, FluxAdapter, FluxPromptEncoder, load

__all__ = ["FLUX_PRESETS", "PIPELINES", "FluxAdapter", "FluxPresetAdapter", "FluxPromptEncoder", "build", "load"]
