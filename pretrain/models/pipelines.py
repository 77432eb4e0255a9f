"""Local diffusers pipeline folders (``model_index.json``): loaded through the model family whose
:attr:`Family.pipelines <pretrain.models.registry.Family.pipelines>` lists the folder's pipeline class.

A family's ``load(path: Path, device: str, options: dict) -> (model, encoder, codec, meta)``: ``model`` is
a :class:`pretrain.backbone.Backbone` (velocity in flow coordinates, the pipeline scheduler's sigmas),
``encoder.encode(prompts) -> PromptEmbeds`` reproduces the pipeline's ``encode_prompt`` (and
``encode([""])`` its unconditional embedding), ``codec`` its VAE; ``meta`` as an export's
``posttrain.json`` (``family``: the family's registry name, ``pipeline``, ``component``: the pipeline
component holding the denoiser, ``transformer`` or ``unet``, ``source``, ``image_size``, ``sampling``,
``options``).

Export and LoRA files are written by :func:`export_pipeline` / :func:`save_pipeline_lora`, so a result
loads back with the family's diffusers pipeline (``from_pretrained``; ``load_lora_weights``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from pretrain.models.registry import FAMILIES, Family, pipeline_classes, pipeline_family
from pretrain.runtime.storage import EXPORT_KEPT, guarded_write

META = "posttrain.json"


def pipeline_class(path: str | Path) -> str | None:
    """The ``_class_name`` of ``path/model_index.json``; None if the folder has none."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return None
    return json.loads(index.read_text()).get("_class_name")


def family_of(path: str | Path) -> Family:
    """The family loading the pipeline folder ``path``. Raises ``ValueError`` naming the folder and its
    pipeline class when no family (with a ``load``) handles it."""
    cls = pipeline_class(path)
    found = pipeline_family(cls)
    if found is None or found[1].load is None:
        raise ValueError(f"{path}: pipeline class '{cls}' has no model family here (known: {pipeline_classes()})")
    return found[1]


def load_pipeline(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a pipeline folder through its family: ``(model, encoder, codec, meta)``. ``options`` (e.g.
    ``image_size``) override those recorded in the folder's ``posttrain.json`` when it is one of our
    exports. Raises ``ConfigError`` (the CLI exits with 2) naming the folder for a bad option or an
    unsupported pipeline, scheduler or size."""
    from pretrain.config import ConfigError

    path = Path(path)
    recorded = json.loads((path / META).read_text()).get("options", {}) if (path / META).is_file() else {}
    try:
        return family_of(path).load(path, device, {**recorded, **dict(options or {})})
    except ValueError as e:  # a bad option or an unsupported folder: a config error naming the folder
        raise ConfigError(f"{path}: {e}") from e


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def export_pipeline(denoiser: torch.nn.Module, meta: dict, out_dir: str | Path) -> Path:
    """Write a complete pipeline folder: the source folder ``meta["source"]`` (files hard-linked where
    possible) with ``denoiser`` saved (``save_pretrained``, safetensors) as its ``meta["component"]``
    (a denoiser of several components, e.g. :class:`pretrain.models.wan.experts.WanExperts`, names
    them in ``components()``: each is saved under its name),
    the family's (``meta["family"]``) ``finalize_export(folder, meta)`` applied when it has one, plus
    ``posttrain.json``. Written to a temporary name, then renamed. Returns ``out_dir``."""
    out, src = Path(out_dir), Path(meta["source"])
    parts = components_of(denoiser, meta["component"])
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with guarded_write("export", out, tmp, EXPORT_KEPT):
        # the saved components are not linked: writing them must never reach the source's files
        shutil.copytree(src, tmp, copy_function=_link_or_copy,
                        ignore=lambda d, names: [n for n in names if Path(d) == src and (n in parts or n == META)])
        for name, part in parts.items():
            part.save_pretrained(tmp / name, safe_serialization=True)
        finalize = FAMILIES[meta["family"]].finalize_export
        if finalize is not None:  # e.g. a replaced scheduler: the export must sample as the run did
            finalize(tmp, meta)
        (tmp / META).write_text(json.dumps({**meta, "source": str(out.resolve())}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def components_of(denoiser: torch.nn.Module, component: str) -> dict[str, torch.nn.Module]:
    """``{folder name: module}`` of ``denoiser``: its ``components()`` when it has several (Wan2.2 A14B's
    experts), else ``{component: denoiser}``."""
    return denoiser.components() if hasattr(denoiser, "components") else {component: denoiser}


def save_lora(denoiser: torch.nn.Module, out_dir: str | Path, pipeline: str | None = None,
              component: str = "transformer") -> Path:
    """Write ``denoiser``'s peft LoRA adapter ("default") into ``out_dir`` as two files, each loading in
    diffusers with default arguments at the trained strength:

    - ``pytorch_lora_weights.safetensors``: keys prefixed ``<component>.``, the adapter's ``LoraConfig``
      in the file's ``lora_adapter_metadata`` (keys prefixed likewise), so the loader keeps its
      ``lora_alpha`` (without it diffusers assumes alpha = rank). Written by the pipeline class
      ``pipeline``'s ``save_lora_weights`` (diffusers' generic LoRA writer when None): the file its
      ``load_lora_weights(out_dir)`` reads, and ``load_lora_adapter(out_dir, weight_name=...)``.
    - ``pytorch_lora_weights.bin``: the file a model's ``load_lora_adapter(out_dir)`` reads when given no
      ``weight_name`` (diffusers' ``ModelMixin`` then looks for this name only, and reads no metadata
      from it): keys prefixed ``transformer.`` (that method's default prefix, a UNet's too), each
      module's scale (``lora_alpha / r``) folded into its ``lora_B``, so alpha = rank gives the
      trained update.

    Returns ``out_dir``."""
    import diffusers
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME, LoraBaseMixin
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(denoiser)
    config = denoiser.peft_config["default"].to_dict()
    # peft keeps target_modules as a set (ordered by string hashes, which vary per process): sorted, the
    # same adapter gives the same metadata in every run
    config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
    if pipeline is None:
        LoraBaseMixin.write_lora_layers(LoraBaseMixin.pack_weights(layers, component), str(out_dir),
                                        is_main_process=True, weight_name=None, save_function=None,
                                        safe_serialization=True,
                                        lora_adapter_metadata=LoraBaseMixin.pack_weights(config, component))
    else:
        getattr(diffusers, pipeline).save_lora_weights(
            str(out_dir), **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": config},
            safe_serialization=True)
    scales = {name: m.scaling["default"] for name, m in denoiser.named_modules()
              if isinstance(m, LoraLayer) and "default" in m.scaling}
    folded = {k: v * scales[k.split(".lora_B.")[0]] if ".lora_B." in k else v for k, v in layers.items()}
    LoraBaseMixin.write_lora_layers(LoraBaseMixin.pack_weights(folded, "transformer"), str(out_dir),
                                    is_main_process=True, weight_name=LORA_WEIGHT_NAME, save_function=None,
                                    safe_serialization=False)
    return Path(out_dir)


def save_pipeline_lora(denoiser: torch.nn.Module, meta: dict, out_dir: str | Path) -> Path:
    """:func:`save_lora` of ``denoiser`` for the export ``meta`` (``pipeline``, ``component``): loads with
    ``Pipeline.load_lora_weights(out_dir)`` and ``pipe.<component>.load_lora_adapter(out_dir)``. A
    denoiser of several components (:func:`components_of`) writes the first one's there and each other
    one's in ``out_dir/<its name>``, with the first one's key prefix (Wan2.2:
    ``pipe.load_lora_weights(out_dir / "transformer_2", load_into_transformer_2=True)``)."""
    parts = list(components_of(denoiser, meta["component"]).items())
    save_lora(parts[0][1], out_dir, meta["pipeline"], parts[0][0])
    for name, part in parts[1:]:
        save_lora(part, Path(out_dir) / name, meta["pipeline"], parts[0][0])
    return Path(out_dir)
