"""FLUX.1 (``FluxTransformer2DModel``): ``FluxPipeline`` folders and their adapter (``pipeline.py``). No
presets of its own and no sequence-parallel plan."""

from pretrain.models.flux.pipeline import FluxAdapter, FluxPromptEncoder, load

__all__ = ["FluxAdapter", "FluxPromptEncoder", "load"]
