"""Exported models: a diffusers denoiser folder (``save_pretrained``: an ``SD3Transformer2DModel``, a
``WanTransformer3DModel``, a ``UNet2DConditionModel``, or a registered family's denoiser) plus
``posttrain.json`` naming its model family (``arch``) and describing the text encoder, codec, sampling
defaults, the adapter's settings (``adapter``, e.g. the UNet's noise scheduler config) and the training
objective it was trained with. Written atomically."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pretrain.codec import CodecConfig, build_codec
from pretrain.models import arch_of
from pretrain.models.pipelines import load_pipeline, pipeline_class
from pretrain.models.registry import pipeline_classes, pipeline_family
from pretrain.runtime.low_precision import plain_weights
from pretrain.runtime.storage import EXPORT_KEPT, guarded_write
from pretrain.text_encoder import TextEncoderConfig, text_encoder_from_config

META = "posttrain.json"


@dataclass
class ExportMeta:
    """What ``posttrain.json`` records beside an exported denoiser. ``text_encoder`` / ``codec``: their
    configs; ``image_size``: pixels per side the model was trained at; ``sampling``: the default
    ``num_inference_steps``, ``guidance_scale`` and ``shift``; ``arch``: its family in
    :data:`pretrain.models.FAMILIES`; ``data``: the training data config as a dict, the default data of
    later stages' evaluation; ``adapter``: the adapter's :meth:`~pretrain.backbone.Backbone.export_settings`,
    recorded when not empty; ``objective``: the ``flow.objective`` it was pretrained with, recorded when
    given (the held-out loss of later evaluations)."""

    text_encoder: TextEncoderConfig
    codec: CodecConfig
    image_size: int
    sampling: dict
    arch: str = "sd3"
    data: dict | None = None
    adapter: dict | None = None
    objective: str | None = None

    def to_json(self) -> dict:
        """The ``posttrain.json`` dict (optional fields only when set)."""
        return {"arch": self.arch, "text_encoder": asdict(self.text_encoder), "codec": asdict(self.codec),
                "image_size": self.image_size, "sampling": self.sampling,
                **{k: getattr(self, k) for k in ("data", "adapter", "objective") if getattr(self, k)}}

    @classmethod
    def from_json(cls, meta: dict) -> "ExportMeta":
        """The record of a loaded export's ``meta`` dict (``arch`` "sd3" when absent)."""
        return cls(TextEncoderConfig(**meta["text_encoder"]), CodecConfig(**meta["codec"]), meta["image_size"],
                   meta["sampling"], meta.get("arch", "sd3"), meta.get("data"), meta.get("adapter"),
                   meta.get("objective"))


def export_model(transformer: torch.nn.Module, out_dir: str | Path, meta: ExportMeta) -> Path:
    """Save ``transformer`` (the denoiser, ``save_pretrained``, safetensors) and ``meta`` (as
    ``posttrain.json``) to ``out_dir``, atomically (a temp folder renamed); returns ``out_dir``."""
    out = Path(out_dir)
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with guarded_write("export", out, tmp, EXPORT_KEPT):
        with plain_weights(transformer):  # torchao's low-precision wrappers hold plain weights inside
            transformer.save_pretrained(tmp, safe_serialization=True)
        (tmp / META).write_text(json.dumps(meta.to_json(), indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def require_export(path: str | None, key: str = "model.pretrained") -> Path:
    """``ConfigError`` naming ``key`` unless ``path`` is an export folder of this project or a diffusers
    pipeline folder of a known family (:mod:`pretrain.models.pipelines`). Returns ``path``."""
    from pretrain.config import ConfigError

    if not path:
        raise ConfigError(f"{key}: required (an export folder written by `posttrain pretrain`, or a local "
                          f"diffusers pipeline folder)")
    cls = pipeline_class(path)
    if cls is not None:
        if pipeline_family(cls) is None:
            raise ConfigError(f"{key}: '{path}' is a {cls} folder; supported pipelines: {pipeline_classes()}")
        return Path(path)
    if not (Path(path) / META).is_file():
        raise ConfigError(f"{key}: '{path}' is not an export folder (no {META}) nor a diffusers pipeline folder "
                          f"(no model_index.json); run the previous stage first")
    return Path(path)


def load_exported(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load an exported folder, or a diffusers pipeline folder through its family
    (:func:`pretrain.models.pipelines.load_pipeline`, with ``options``): returns (adapter, text encoder,
    codec, meta dict); an export's denoiser is the class of its family (``meta["arch"]``, "sd3" when
    absent) in float32 on ``device``, in eval mode, wrapped by the family's adapter with the recorded
    ``meta["adapter"]`` settings (:meth:`pretrain.models.Family.wrap`). Raises ``FileNotFoundError``
    naming the folder if it is neither, ``ValueError`` naming ``model.arch`` for an unregistered family
    and the adapter's ``ValueError`` for settings it does not take."""
    path = Path(path)
    if pipeline_class(path) is not None:
        return load_pipeline(path, device, options)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path}: no {META} (expected a folder written by `posttrain pretrain`)")
    meta = json.loads((path / META).read_text())
    arch = arch_of(meta.get("arch", "sd3"))
    transformer = arch.denoiser_class().from_pretrained(path).to(device).eval()
    encoder = text_encoder_from_config(TextEncoderConfig(**meta["text_encoder"]), device=device)
    codec = build_codec(CodecConfig(**meta["codec"]), device=device)
    return arch.wrap(transformer, meta.get("adapter")), encoder, codec, meta
