"""Stable Diffusion 1.x / 2.x and SDXL (``UNet2DConditionModel``): the adapter behind the flow-matching
interface (``adapter.py``) through variance-preserving flow coordinates (``vp_schedule.py``), the
project's own pixel-space presets (``model.py``) and pipeline folders (``pipeline.py``). No
sequence-parallel plan."""

from pretrain.models.unet.adapter import UNET_ATTENTION, UNetAdapter
from pretrain.models.unet.model import UNET_PRESETS, UNET_SCHEDULER, build, preset_settings
from pretrain.models.unet.pipeline import UNetPromptEncoder, finalize_export, load

__all__ = ["UNET_ATTENTION", "UNET_PRESETS", "UNET_SCHEDULER", "UNetAdapter", "UNetPromptEncoder", "build",
           "finalize_export", "load", "preset_settings"]
