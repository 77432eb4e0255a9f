"""Gather an FSDP2-sharded model into one plain module on rank 0, for exports loadable in one process.

``unsharded_copy(model)`` all-gathers the full state dict to rank 0's CPU
(``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``) and loads it
into a freshly built module of the same class, config and peft adapters, keeping every parameter's dtype
(a bf16 base stays bf16, fp32 LoRA stays fp32). The usual single-process exports then apply unchanged on
rank 0: ``save_full_pretrained`` (diffusers folder, LoRA fused) and ``save_lora_adapter`` (peft/diffusers
LoRA safetensors, the format ``load_lora_adapter`` reads); ``pretrain.export.export_model`` on the copy's
``.transformer`` writes this project's export folder.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _plain_class(module: torch.nn.Module) -> type:
    """The class ``fully_shard`` replaced (it swaps ``type(m)`` for a subclass of ``FSDPModule``)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def _skeleton(transformer: torch.nn.Module) -> torch.nn.Module:
    """A new diffusers transformer with ``transformer``'s config and peft adapters (values not copied); for
    a module of several denoisers without a ``from_config`` (Wan2.2 A14B's experts), its settings around a
    skeleton of each child."""
    cls = _plain_class(transformer)
    if not hasattr(cls, "from_config"):
        plain = _shallow_plain(transformer)
        for name, child in transformer._modules.items():
            plain._modules[name] = _skeleton(child)
        return plain
    plain = cls.from_config(transformer.config)
    for name, cfg in getattr(transformer, "peft_config", {}).items():
        plain.add_adapter(copy.deepcopy(cfg), adapter_name=name)
    return plain


def _shallow_plain(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s attributes as its plain class, without the hooks ``fully_shard`` put on it (the
    registries are copied, so ``module`` is untouched)."""
    plain = object.__new__(_plain_class(module))  # FSDP2's class would re-run __init__ on copy
    for name, value in module.__dict__.items():
        if name.startswith("_") and isinstance(value, dict):
            value = type(value)() if "hooks" in name else type(value)(value)
        plain.__dict__[name] = value
    return plain


def _plain_adapter(model: torch.nn.Module, transformer: torch.nn.Module) -> torch.nn.Module:
    """``model``'s adapter settings (schedulers, guidance, ...) around ``transformer``, as its plain
    class and without the hooks ``fully_shard`` put on the root. Pipeline-folder adapters take a
    scheduler object that ``export_settings`` does not record, so ``from_settings`` cannot rebuild them."""
    plain = _shallow_plain(model)
    plain._modules["transformer"] = transformer
    return plain


def _routed_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective under expert parallelism: on rank 0, the full CPU values of the routed experts the other
    EP ranks hold (their parameters live on the ``dp_shard_mod_ep`` mesh, ``expert.py``), which a full state
    dict, gathered to rank 0 alone, would miss; empty elsewhere and without EP.

    EP rank r (r > 0) of the first group (global rank r: EP ranks are the innermost ``ep`` ranks) sends its
    experts to rank 0 one tensor at a time (names, shapes and dtypes first), each all-gathered over the
    ranks sharing it just before, so no rank holds more than one unsharded expert tensor beyond its own."""
    from pretrain.parallel.expert import EXPERT_SHARD_DIM

    local = [(name, p) for name, p in model.named_parameters()
             if EXPERT_SHARD_DIM in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())]
    if not local:
        return {}
    rank, ep = dist.get_rank(), dist.get_world_size() // local[0][1].device_mesh.size()
    ep_rank, first = rank % ep, local[0][1].device_mesh.get_local_rank() == 0
    out = {}
    if rank == 0:
        for source in range(1, ep):
            meta = [None]
            dist.recv_object_list(meta, src=source)
            for name, shape, dtype in meta[0]:
                buffer = torch.empty(shape, dtype=dtype, device=local[0][1].device)
                dist.recv(buffer, src=source)
                out[name] = buffer.cpu()
    elif ep_rank:
        if first:
            dist.send_object_list([[(n, tuple(p.shape), p.dtype) for n, p in local]], dst=0)
        for _, p in local:
            full = p.full_tensor().detach().contiguous()  # over the ranks sharing these experts
            if first:
                dist.send(full, dst=0)
    return out


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """Collective: on rank 0, a plain CPU copy of ``model`` (a model adapter, its settings kept
    (:func:`_plain_adapter`), or a diffusers denoiser; FSDP2-, TP-, CP- or expert-parallel or not)
    with the same parameter names, values and dtypes; None on other ranks."""
    experts = _routed_experts(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not _is_rank0():
        return None
    full.update(experts)
    inner = getattr(model, "transformer", None)
    if inner is None:
        plain = _skeleton(model)
    else:
        plain = _plain_adapter(model, _skeleton(inner))
    plain.load_state_dict(full, strict=True, assign=True)
    return plain.requires_grad_(False)


def save_lora_adapter(model: torch.nn.Module, out_dir: str | Path) -> Path | None:
    """Collective: write ``model``'s LoRA adapter (peft keys, safetensors) from rank 0; returns the folder
    on rank 0, None elsewhere."""
    plain = unsharded_copy(model)
    if plain is None:
        return None
    getattr(plain, "transformer", plain).save_lora_adapter(str(out_dir), safe_serialization=True)
    return Path(out_dir)


def save_full_pretrained(model: torch.nn.Module, out_dir: str | Path) -> Path | None:
    """Collective: write the full denoiser (LoRA fused, adapters removed) as a diffusers folder from
    rank 0 (its class's ``from_pretrained(out_dir)`` loads it, e.g. ``SD3Transformer2DModel``); None on
    other ranks."""
    plain = unsharded_copy(model)
    if plain is None:
        return None
    transformer = getattr(plain, "transformer", plain)
    if getattr(transformer, "peft_config", None):
        transformer.fuse_lora()
        transformer.unload_lora()
    transformer.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)
