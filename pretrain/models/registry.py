"""The one table of model families: name -> :class:`Family` (its presets and build function, its adapter
class, its denoiser class, the diffusers pipeline classes it loads). ``model.arch`` of a pretraining
config, ``meta["arch"]`` of an export and ``meta["family"]`` of a pipeline export name a row; a pipeline
folder's ``_class_name`` finds its row through :attr:`Family.pipelines`.

A new family is one folder ``pretrain/models/<family>/`` plus one row here, or, without editing the
project, :func:`register_family` (and :func:`unregister_family` to undo it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pretrain.backbone import Backbone
from pretrain.registry import Registry
import pretrain.models.flux as flux
import pretrain.models.flux2 as flux2
import pretrain.models.hidream as hidream
import pretrain.models.ltx2 as ltx2
import pretrain.models.qwenimage as qwenimage
import pretrain.models.sd3 as sd3
import pretrain.models.unet as unet
import pretrain.models.wan as wan
import pretrain.models.zimage as zimage


@dataclass(frozen=True)
class Family:
    """One model family.

    - ``adapter``: its :class:`pretrain.backbone.Backbone` subclass; ``adapter.from_settings(denoiser,
      settings)`` (:meth:`wrap`; ``adapter(denoiser)`` when it needs no settings) wraps a denoiser
      built from a preset or loaded from an export (``forward(x, sigma [B], embeds) -> velocity`` float32
      like ``x``), and its ``blocks()`` / ``sequence_parallel(group)`` are what parallelism uses.
    - ``denoiser``: the denoiser's class, or the name of a ``diffusers`` class (resolved lazily): exports
      load with its ``from_pretrained`` (:meth:`denoiser_class`).
    - ``presets``: preset name -> constructor fields, for pretraining (empty: pipeline folders only).
    - ``build(cfg: ModelConfig, sample_size, channels, text_dim, pooled_dim) -> denoiser``: a new float32
      denoiser from ``cfg.preset`` / ``cfg.overrides`` (or ``cfg.pretrained``) for latents of
      ``channels`` channels and ``sample_size`` side and text states of width ``text_dim`` / ``pooled_dim``;
      raises ``ValueError`` for an unknown preset. None: the family has no presets.
    - ``video``: its presets take videos (the ``video_patchify`` codec) rather than images (``patchify``).
    - ``overrides``: ``model.overrides`` keys accepted besides the preset fields.
    - ``pipelines``: the diffusers pipeline class names (``model_index.json`` ``_class_name``) it loads.
    - ``load(path, device, options) -> (model, encoder, codec, meta)``: loads such a folder (see
      :mod:`pretrain.models.pipelines`); ``finalize_export(folder, meta)``: optional, fixes up a written
      pipeline export (e.g. a replaced scheduler).
    - ``adapter_settings(cfg: ModelConfig) -> dict``: optional, what the adapter needs besides a preset's
      denoiser (``adapter.from_settings(denoiser, settings)``, e.g. the UNet's noise scheduler config);
      raises ``ValueError`` naming the key for a bad one. None: ``{}``. Exports record the adapter's
      :meth:`~pretrain.backbone.Backbone.export_settings` and load through ``from_settings`` (:meth:`wrap`).
    """

    adapter: type[Backbone]
    denoiser: str | type[torch.nn.Module]
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    build: Callable[..., torch.nn.Module] | None = None
    video: bool = False
    overrides: tuple[str, ...] = ()
    pipelines: tuple[str, ...] = ()
    load: Callable[..., tuple] | None = None
    finalize_export: Callable[..., None] | None = None
    adapter_settings: Callable[..., dict] | None = None

    def denoiser_class(self) -> type[torch.nn.Module]:
        """The denoiser class (``getattr(diffusers, denoiser)`` for a name)."""
        if isinstance(self.denoiser, str):
            import diffusers

            return getattr(diffusers, self.denoiser)
        return self.denoiser

    def wrap(self, denoiser: torch.nn.Module, settings: dict | None = None) -> Backbone:
        """The adapter around ``denoiser``: ``adapter.from_settings(denoiser, settings or {})`` (raises its
        ``ValueError`` for settings it does not take)."""
        return self.adapter.from_settings(denoiser, dict(settings or {}))


FAMILIES: Registry = Registry("model family", {
    "sd3": Family(sd3.SD3Adapter, "SD3Transformer2DModel", sd3.SD3_PRESETS, sd3.build_transformer,
                  overrides=("qk_norm", "dual_attention_layers", "in_channels"),
                  pipelines=(sd3.PIPELINE,), load=sd3.load),
    "wan": Family(wan.WanVideoAdapter, "WanTransformer3DModel", wan.WAN_PRESETS, wan.build, video=True,
                  overrides=("qk_norm",), pipelines=wan.PIPELINES, load=wan.load),
    "flux": Family(flux.FluxPresetAdapter, "FluxTransformer2DModel", flux.FLUX_PRESETS, flux.build,
                   pipelines=flux.PIPELINES, load=flux.load),
    "flux2": Family(flux2.Flux2Adapter, "Flux2Transformer2DModel", pipelines=(flux2.PIPELINE,), load=flux2.load),
    "qwenimage": Family(qwenimage.QwenImageAdapter, "QwenImageTransformer2DModel", pipelines=qwenimage.PIPELINES,
                        load=qwenimage.load),
    "zimage": Family(zimage.ZImageAdapter, "ZImageTransformer2DModel", pipelines=(zimage.PIPELINE,), load=zimage.load),
    "hidream": Family(hidream.HiDreamAdapter, "HiDreamImageTransformer2DModel", pipelines=(hidream.PIPELINE,),
                      load=hidream.load),
    "ltx2": Family(ltx2.LTX2Adapter, "LTX2VideoTransformer3DModel", pipelines=(ltx2.PIPELINE,), load=ltx2.load),
    "unet": Family(unet.UNetAdapter, "UNet2DConditionModel", unet.UNET_PRESETS, unet.build, overrides=("scheduler",),
                   pipelines=("StableDiffusionPipeline", "StableDiffusionXLPipeline"), load=unet.load,
                   finalize_export=unet.finalize_export, adapter_settings=unet.preset_settings),
}, key="model.arch")


def register_family(name: str, family: Family, replace: bool = False) -> None:
    """Add ``family`` under ``name`` (then ``model.arch: name`` and its pipeline classes resolve to it).
    Raises ``ValueError`` if ``name`` is taken or one of its pipeline classes belongs to another family,
    unless ``replace``."""
    if not replace:
        if name in FAMILIES:
            raise ValueError(f"model family '{name}' is already registered")
        taken = {p: n for n, f in FAMILIES.items() for p in f.pipelines}
        clash = sorted(p for p in family.pipelines if p in taken)
        if clash:
            raise ValueError(f"model family '{name}': pipeline class(es) {clash} already belong to "
                             f"{sorted({taken[p] for p in clash})}")
    FAMILIES.register(name, family, replace=True)


def unregister_family(name: str) -> Family:
    """Remove and return the family ``name``; ``KeyError`` naming it if it is not registered."""
    return FAMILIES.unregister(name)


def arch_of(name: str) -> Family:
    """``FAMILIES[name]``; ``ValueError`` naming ``model.arch`` otherwise."""
    return FAMILIES.get(name, "model.arch")


def pipeline_family(pipeline: str | None) -> tuple[str, Family] | None:
    """``(name, family)`` of the family loading the diffusers pipeline class ``pipeline``; None if none."""
    return next(((n, f) for n, f in FAMILIES.items() if pipeline in f.pipelines), None)


def pipeline_classes() -> list[str]:
    """Every pipeline class name some family loads, sorted."""
    return sorted(p for f in FAMILIES.values() for p in f.pipelines)


def denoiser_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a bare denoiser (what its family's adapter ``blocks()`` returns, in forward
    order), found through the family whose denoiser class it is an instance of. Raises ``ValueError``
    naming the class when no registered family has it (or it has no blocks)."""
    for family in FAMILIES.values():
        if isinstance(denoiser, family.denoiser_class()):
            return family.adapter.blocks_of(denoiser)
    raise ValueError(f"{type(denoiser).__name__}: not the denoiser of a registered model family "
                     f"(known: {sorted(FAMILIES)})")
