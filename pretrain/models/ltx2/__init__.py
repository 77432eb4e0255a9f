"""LTX-2 (``LTX2Pipeline``, an audio-video diffusion transformer): pipeline folders, their adapter
(``pipeline.py``) and the joint video + audio state's codec (``codec.py``). No presets; no tensor, sequence or
context parallel plan."""

from pretrain.models.ltx2.codec import LTX2Codec
from pretrain.models.ltx2.pipeline import LTX2_ATTENTION, PIPELINE, LTX2Adapter, LTX2PromptEncoder, load

__all__ = ["LTX2_ATTENTION", "PIPELINE", "LTX2Adapter", "LTX2Codec", "LTX2PromptEncoder", "load"]
