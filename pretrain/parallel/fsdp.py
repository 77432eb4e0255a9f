"""Parallelize an SD3 model: activation checkpointing -> compile -> FSDP2, torchtitan's order
(``torchtitan/models/flux/parallelize.py``; TP would come first and is not implemented).

FSDP2 (``fully_shard``) is applied to every LoRA layer (when peft adapters are present), then every
``transformer.transformer_blocks[i]``, then the root. One FSDP unit all-gathers its parameters before
its forward and frees them after (``reshard_after_forward``; the last block keeps them, as torchtitan
does, since backward starts there), and reduce-scatters its gradients in backward.

LoRA under FSDP2: adapters are added by peft *before* sharding, with a frozen base that may be
bf16 and trainable fp32 adapters. Each peft ``lora_A`` / ``lora_B`` module is its own FSDP unit with
``param_dtype=None`` (the fp32 weights are gathered and used in fp32; peft casts the activation to the
adapter's dtype and the result back), so fp32 adapter gradients are reduced in fp32 and a bf16
``MixedPrecisionPolicy`` never rounds the adapters. The frozen base units follow ``cfg.param_dtype``.
(A block holding both bf16 and fp32 parameters in one unit also works in torch 2.14 -- the all-gather
falls back to bytes -- but then ``param_dtype`` would cast the adapters too.)
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pretrain.parallel.config import DTYPES, ParallelConfig
from pretrain.parallel.dims import Mesh


def transformer_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ``SD3Transformer2DModel`` inside an ``SD3Adapter`` (or the model itself)."""
    return getattr(model, "transformer", model)


def lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's per-adapter ``lora_A`` / ``lora_B`` modules inside ``module`` (empty without peft layers)."""
    from peft.tuners.lora import LoraLayer

    out = []
    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            out += [*layer.lora_A.values(), *layer.lora_B.values()]
    return out


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block's activations in backward (non-reentrant ``torch.utils.checkpoint``
    through the composable ``checkpoint``, which keeps parameter names unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in transformer_of(model).transformer_blocks:
        checkpoint(block)


def apply_compile(model: torch.nn.Module) -> None:
    """``torch.compile`` each transformer block in place (names unchanged), as torchtitan does per block."""
    for block in transformer_of(model).transformer_blocks:
        block.compile()


def apply_fsdp(model: torch.nn.Module, mesh: Mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """``fully_shard`` LoRA layers (fp32, their own units), each transformer block, then the root.

    With ``sp`` > 1 the shard mesh includes the SP ranks; they hold the same samples, so gradients are
    summed over them and averaged only over the ``dims.dp`` data shards (``set_gradient_divide_factor``).
    This matches a loss computed on the gathered full output on every SP rank (``sequence.py``)."""
    fsdp_mesh = mesh.fsdp_mesh()
    base = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    exact = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for layer in lora_layers(model):
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=exact)
    blocks = list(transformer_of(model).transformer_blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=fsdp_mesh, mp_policy=base, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=base)
    if mesh.dims.sp > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(mesh.dims.dp))
                module.set_force_sum_reduction_for_comms(True)


def parallelize(model: torch.nn.Module, mesh: Mesh, cfg: ParallelConfig) -> torch.nn.Module:
    """Apply activation checkpointing, compile and FSDP2 to ``model`` (an ``SD3Adapter`` or an
    ``SD3Transformer2DModel``) in place, in torchtitan's order; returns ``model``.

    Call after adding peft adapters and after moving the model to its device. Parameters become
    ``DTensor`` shards over ``mesh.fsdp_mesh()``; the same call shards a frozen full-fine-tuning reference
    copy (its parameters have ``requires_grad=False``; it then only all-gathers)."""
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model)
    apply_fsdp(model, mesh, DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype])
    return model
