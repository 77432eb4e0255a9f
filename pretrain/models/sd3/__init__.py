"""SD3 / SD3.5 (``SD3Transformer2DModel``): the project's pixel-space presets and their adapter
(``model.py``), ``StableDiffusion3Pipeline`` folders (``pipeline.py``) and the Ulysses sequence-parallel
plan (``sequence_parallel.py``)."""

from pretrain.models.sd3.model import SD3_ATTENTION, SD3_PRESETS, SD3Adapter, build_transformer
from pretrain.models.sd3.pipeline import PIPELINE, SD3PipelineAdapter, SD3PromptEncoder, load

__all__ = ["PIPELINE", "SD3_ATTENTION", "SD3_PRESETS", "SD3Adapter", "SD3PipelineAdapter", "SD3PromptEncoder",
           "build_transformer", "load"]
