"""Parallelize a model adapter: tensor parallelism (``tp`` > 1, ``tensor.py``) -> context parallelism
(``cp`` > 1, ``context.py``) -> activation
checkpointing -> compile -> FSDP2, torchtitan's order (``torchtitan/models/flux/parallelize.py``).

FSDP2 (``fully_shard``) is applied to every block the adapter lists (:meth:`pretrain.backbone.Backbone.blocks`:
SD3's ``transformer_blocks``, FLUX's double and single blocks, Wan's ``blocks``, a UNet's down / mid / up
blocks), then the root. One FSDP unit all-gathers its parameters before
its forward and frees them after (``reshard_after_forward``; the last block keeps them, as torchtitan
does, since backward starts there), and reduce-scatters its gradients in backward.

LoRA under FSDP2: peft adapters are added *before* sharding. ``parallelize`` then stores every frozen
parameter in ``cfg.param_dtype`` (a frozen base needs no fp32 master copy: bf16 halves its memory and
all-gather traffic) and leaves trainable ones in their dtype (fp32 adapters). A block is one FSDP unit
holding both dtypes: FSDP2 all-gathers a unit of mixed dtypes as bytes (``_get_all_gather_input_metadatas``
falls back to uint8; measured on torch 2.14 with gloo), and reduce-scatter only needs the *gradients* to share a dtype, which
holds since only the fp32 adapters get gradients. With LoRA layers present the policy's ``param_dtype`` is
therefore None: each parameter computes in its stored dtype -- the base in bf16, the adapters exactly in
fp32 (peft casts the activation to the adapter's dtype and the result back). Measured alternatives (torch
2.14, gloo): the same units with ``param_dtype=bf16`` also train but round the adapters to bf16 for
compute; sharding each ``lora_A`` / ``lora_B`` as its own fp32 unit works too but costs two extra
collectives per adapted projection (~15 per block), so it is not used. Without LoRA (full fine-tuning,
or its frozen reference copy) the policy is ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pretrain.parallel.config import DTYPES, ParallelConfig
from pretrain.parallel.dims import Mesh


def block_units(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> list[torch.nn.Module]:
    """``blocks`` if given, else the adapter's ``model.blocks()`` (its denoiser's repeated blocks, in
    forward order). Raises ``ValueError`` naming the class of a model that is not an adapter when no
    ``blocks`` are given."""
    if blocks is not None:
        return list(blocks)
    method = getattr(model, "blocks", None)
    if not callable(method) or isinstance(method, torch.nn.Module):  # e.g. Wan's own ``blocks`` ModuleList
        raise ValueError(f"parallelize: {type(model).__name__} is not a model adapter (no blocks()); "
                         f"pass its blocks explicitly")
    return list(method())


def lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's per-adapter ``lora_A`` / ``lora_B`` modules inside ``module`` (empty without peft layers)."""
    from peft.tuners.lora import LoraLayer

    out = []
    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            out += [*layer.lora_A.values(), *layer.lora_B.values()]
    return out


def apply_activation_checkpointing(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
    """Recompute each block's (:func:`block_units`) activations in backward (non-reentrant
    ``torch.utils.checkpoint`` through the composable ``checkpoint``, which keeps parameter names unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in block_units(model, blocks):
        checkpoint(block)


def apply_compile(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
    """``torch.compile`` each block (:func:`block_units`) in place (names unchanged), as torchtitan does per block."""
    for block in block_units(model, blocks):
        block.compile()


def apply_fsdp(model: torch.nn.Module, mesh: Mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               blocks: list[torch.nn.Module] | None = None, experts: list[list[torch.nn.Module]] = ()) -> None:
    """``fully_shard`` each block (:func:`block_units`; the last without resharding after forward), then the root.

    Frozen parameters are cast to ``param_dtype`` first; with LoRA layers present, units compute each
    parameter in its stored dtype (see the module docstring). With ``sp`` or ``cp`` > 1 the shard mesh
    includes the SP / CP ranks; they hold the same samples, so gradients are summed over them and averaged only over the
    ``dims.dp`` data shards (``set_gradient_divide_factor``). This matches a loss computed on the gathered
    full output on every SP rank (``sequence.py``).

    ``experts``: with ``ep`` > 1, each MoE layer's local routed experts (``expert.py``), sharded first, one
    unit per layer, over the ranks holding the same experts; their gradients sum every rank's tokens
    already, so they are divided by the whole data-parallel degree."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(param_dtype)
    lora = bool(lora_layers(model))
    policy = MixedPrecisionPolicy(param_dtype=None if lora else param_dtype, reduce_dtype=reduce_dtype)
    fsdp_mesh = mesh.fsdp_mesh()
    blocks = block_units(model, blocks)
    for unit in experts:
        expert_mesh = mesh.expert_mesh["dp_shard_mod_ep"]
        fully_shard(unit, mesh=expert_mesh, mp_policy=policy)
        unit[0].set_gradient_divide_factor(float(mesh.dims.dp))
        # sum, then divide: gloo has no PREMUL_SUM; on one rank torch 2.14 would divide twice with it set
        unit[0].set_force_sum_reduction_for_comms(expert_mesh.size() > 1)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    if mesh.dims.sp * mesh.dims.cp > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(mesh.dims.dp))
                module.set_force_sum_reduction_for_comms(True)


def parallelize(model: torch.nn.Module, mesh: Mesh, cfg: ParallelConfig,
                blocks: list[torch.nn.Module] | None = None) -> torch.nn.Module:
    """Apply expert parallelism (``ep`` > 1: the adapter's ``moe_layers()``, ``expert.py``), tensor
    parallelism (``mesh.tp_size`` > 1: the adapter's plan over ``mesh.tp_mesh()``),
    context parallelism (``cp`` > 1: the denoiser's diffusers plan over ``mesh.cp_mesh``), activation
    checkpointing, compile and FSDP2 to ``model`` in place, in torchtitan's order; returns
    ``model``. ``model``: a :class:`pretrain.backbone.Backbone` adapter (its ``blocks()`` are the
    units), or any module with its ``blocks`` given (e.g. a bare diffusers denoiser and
    ``Adapter.blocks_of(denoiser)``). Raises ``ValueError`` (:func:`block_units`) for a model without blocks.

    Call after adding peft adapters (and freezing the base) and after moving the model to its device.
    Parameters become ``DTensor`` shards over ``mesh.fsdp_mesh()``; the same call shards a frozen
    full-fine-tuning reference copy (``requires_grad=False`` everywhere: stored in ``param_dtype``, it only
    all-gathers)."""
    blocks = block_units(model, blocks)
    experts = []
    if mesh.dims.ep > 1:
        from pretrain.parallel.expert import apply_expert_parallel

        layers = model.moe_layers() if hasattr(model, "moe_layers") else []
        if not layers:
            raise ValueError(f"parallel.ep={mesh.dims.ep}: {type(model).__name__} has no routed experts "
                             f"(expert parallelism needs a mixture-of-experts denoiser, e.g. HiDream)")
        experts = apply_expert_parallel(layers, mesh.expert_mesh["ep"])
    if mesh.tp_size > 1:
        from pretrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.tp_mesh())
    if mesh.dims.cp > 1:
        from pretrain.parallel.context import enable_context_parallel

        enable_context_parallel(model, mesh.cp_mesh)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, blocks)
    if cfg.compile:
        apply_compile(model, blocks)
    apply_fsdp(model, mesh, DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype], blocks, experts)
    return model
