"""FLUX.1 (``FluxTransformer2DModel``): ``FluxPipeline`` folders and their adapter (``pipeline.py``), and
pixel-space presets for CPU pretraining (``model.py``). No sequence-parallel plan."""

from pretrain.models.flux.model import FLUX_PRESETS, FluxPresetAdapter, build
from pretrain.models.flux.pipeline import FluxAdapter, FluxPromptEncoder, load

__all__ = ["FLUX_PRESETS", "FluxAdapter", "FluxPresetAdapter", "FluxPromptEncoder", "build", "load"]
