"""FLUX.2 [klein] (``Flux2Transformer2DModel``): ``Flux2KleinPipeline`` folders and their adapter
(``pipeline.py``). No presets, no sequence- or tensor-parallel plan."""

from pretrain.models.flux2.pipeline import PIPELINE, Flux2Adapter, Flux2Codec, Flux2PromptEncoder, load

__all__ = ["PIPELINE", "Flux2Adapter", "Flux2Codec", "Flux2PromptEncoder", "load"]
