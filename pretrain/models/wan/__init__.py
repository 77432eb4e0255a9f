"""Wan2.1 / Wan2.2 video (``WanTransformer3DModel``): the project's pixel-space presets and their adapter
(``model.py``), ``WanPipeline`` and ``WanImageToVideoPipeline`` folders (``pipeline.py``) with their video
VAE codecs (``codec.py``) and the Ulysses sequence-parallel plan (``sequence_parallel.py``)."""

from pretrain.models.wan.codec import WanImageToVideoCodec, WanVideoCodec, check_num_frames
from pretrain.models.wan.model import WAN_ATTENTION, WAN_PRESETS, WanVideoAdapter, build, build_wan_transformer
from pretrain.models.wan.pipeline import PIPELINE, PIPELINES, WanAdapter, WanPromptEncoder, load

__all__ = ["PIPELINE", "PIPELINES", "WAN_ATTENTION", "WAN_PRESETS", "WanAdapter", "WanImageToVideoCodec",
           "WanPromptEncoder", "WanVideoAdapter", "WanVideoCodec", "build", "build_wan_transformer", "check_num_frames",
           "load"]
