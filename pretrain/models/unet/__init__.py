"""Stable Diffusion 1.x / 2.x and SDXL (``UNet2DConditionModel``): their pipeline folders behind the
flow-matching interface (``pipeline.py``) through variance-preserving flow coordinates
(``vp_schedule.py``). No presets of its own and no sequence-parallel plan."""

from pretrain.models.unet.pipeline import UNetAdapter, UNetPromptEncoder, finalize_export, load

__all__ = ["UNetAdapter", "UNetPromptEncoder", "finalize_export", "load"]
