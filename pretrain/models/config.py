"""``model:`` of a run config: which family, preset or pretrained folder, and loading options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Backbone choice. ``arch``: a registered family (:data:`pretrain.models.FAMILIES`) with presets: "sd3"
    (``SD3Transformer2DModel``, images) or "wan" (``WanTransformer3DModel``, videos); ``preset`` names an
    entry of that family's ``presets``; ``pretrained`` is a local diffusers folder (denoiser weights)
    that overrides the preset; ``overrides`` patch preset fields. Post-training stages take
    ``pretrained`` = an export of this project or a diffusers pipeline folder of a known family
    (:mod:`pretrain.models.pipelines`), loaded with ``options`` (e.g. ``image_size``, ``num_frames``,
    ``guidance``, ``max_sequence_length``: see the family's ``load``)."""

    arch: str = "sd3"
    preset: str = "tiny"
    pretrained: str | None = None
    subfolder: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
