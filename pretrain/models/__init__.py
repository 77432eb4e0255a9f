"""Model families, one folder each (``sd3/``, ``wan/``, ``flux/``, ``unet/``: presets, adapter, pipeline
loader, codec, sequence-parallel plan), registered in one table (:mod:`pretrain.models.registry`), and
what the trainers call: :class:`ModelConfig`, :func:`build_backbone`, :func:`count_parameters`.
Pipeline folders load and export through :mod:`pretrain.models.pipelines`."""

from __future__ import annotations

import torch

from pretrain.backbone import Backbone
from pretrain.models.config import ModelConfig
from pretrain.models.registry import (FAMILIES, Family, arch_of, denoiser_blocks, pipeline_classes, pipeline_family,
                                      register_family, unregister_family)

__all__ = ["FAMILIES", "Family", "ModelConfig", "arch_of", "build_backbone", "count_parameters", "denoiser_blocks",
           "pipeline_classes", "pipeline_family", "register_family", "unregister_family"]


def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    """The number of elements of ``module``'s parameters (only those with ``requires_grad`` when
    ``trainable_only``)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def build_backbone(cfg: ModelConfig, sample_size: int, channels: int, text_dim: int, pooled_dim: int) -> Backbone:
    """The adapter of family ``cfg.arch`` around a new (or ``cfg.pretrained``) denoiser built by its
    ``build``, with the family's ``adapter_settings(cfg)`` (see :class:`Family`). Raises ``ValueError``
    naming ``model.arch`` for an unknown family or one without presets, and the build's (or settings')
    ``ValueError`` for a bad preset, size or setting."""
    family = arch_of(cfg.arch)
    if family.build is None:
        raise ValueError(f"model.arch: '{cfg.arch}' has no presets to build (its pipeline folders load as "
                         f"model.pretrained of a post-training stage)")
    settings = family.adapter_settings(cfg) if family.adapter_settings else {}
    return family.wrap(family.build(cfg, sample_size, channels, text_dim, pooled_dim), settings)
