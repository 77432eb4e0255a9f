"""Wan2.1 video (``WanTransformer3DModel``): the project's pixel-space presets and their adapter
(``model.py``), ``WanPipeline`` folders (``pipeline.py``) with their video VAE codec (``codec.py``) and the
Ulysses sequence-parallel plan (``sequence_parallel.py``)."""

from pretrain.models.wan.codec import WanVideoCodec, check_num_frames
from pretrain.models.wan.model import WAN_ATTENTION, WAN_PRESETS, WanVideoAdapter, build, build_wan_transformer
from pretrain.models.wan.pipeline import PIPELINE, WanAdapter, WanPromptEncoder, load

__all__ = ["PIPELINE", "WAN_ATTENTION", "WAN_PRESETS", "WanAdapter", "WanPromptEncoder", "WanVideoAdapter",
           "WanVideoCodec", "build", "build_wan_transformer", "check_num_frames", "load"]
