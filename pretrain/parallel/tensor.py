"""Tensor parallelism (Megatron-LM's layout, Shoeybi et al. 2019, arXiv 1909.08053, section 3) of a model
adapter's blocks with PyTorch DTensor's ``parallelize_module``: this module applies a family's plan and
knows no model; the plans live with their families (:meth:`pretrain.backbone.Backbone.tensor_parallel_plan`,
e.g. ``pretrain/models/sd3/tensor_parallel.py``).

A plan maps module-name patterns (``*`` matches one index of a ``ModuleList``; patterns matching nothing,
e.g. the last SD3 block's missing context MLP, are skipped) to a style:

- ``"colwise"``: ``ColwiseParallel`` -- weight and bias ``Shard(0)`` over the TP ranks; the replicated
  input stays whole (its gradient is all-reduced in backward) and each rank keeps its slice of the output
  features (attention heads ``[r H/tp, (r+1) H/tp)``, or a slice of the MLP's hidden units).
- ``"rowwise"``: ``RowwiseParallel`` -- weight ``Shard(1)``, bias replicated; takes the slice a colwise
  layer produced and all-reduces the partial products, so the output is whole again on every rank.
- ``"colwise_gather"``: ``ColwiseParallel(output_layouts=Replicate())`` -- weight sharded like colwise, the
  output all-gathered. For the AdaLN modulation projections (conditioning ``[B, D]`` -> ``[B, 6 D]``, a
  third of an MMDiT block's weights): their outputs are one vector per sample, so gathering them costs
  nothing next to the token activations, and the weights no longer sit whole on every TP rank.
- ``"gather_input"``: the layer stays replicated and its input, ``len(blocks)`` column slices made by
  colwise layers side by side (FLUX's single-block ``proj_out`` reads ``cat([attention, mlp])``), is
  all-gathered slice by slice first (:func:`gather_blocks`). diffusers shards that layer packed-rowwise
  (each rank stores its columns of both parts); that layout's ``full_tensor()`` is not the weight in its
  original column order, so a gathered export would be wrong, and it is not used.
- ``"head_norm"``: a norm with a replicated weight applied per head inside the sharded region (SD3's and
  FLUX's q / k RMS norms over ``head_dim``). Each rank sees only its heads, so its weight gradient is
  partial: ``SequenceParallel`` makes the weight a ``Replicate`` DTensor and the input a ``Shard``
  DTensor, so autograd all-reduces that gradient. The shard is declared on dim 0: a norm over the last dim
  computes the same on any split of the other dims, and the output goes back to a local tensor at once.
- ``"norm_across_heads"``: an ``RMSNorm`` over all heads' features (Wan's q/k norm) on a colwise output:
  weight ``Shard(0)``; the mean square is summed over the TP ranks (:class:`ShardedRMSNorm`).

LoRA (peft ``LoraLayer``): the base layer gets the style, and the adapters follow it so that the adapter
path has the base's layout: under a colwise base (or colwise_gather), ``lora_B`` is styled like it and
``lora_A`` stays replicated
(the gradient of its output arrives whole through ``lora_B``'s input all-reduce); under a rowwise base, ``lora_A``
is rowwise (an all-reduce of ``r`` features) and ``lora_B`` stays replicated. Every replicated parameter
then gets the same, complete gradient on every TP rank, so FSDP2 (applied after, over the data-parallel
ranks) reduces it as before. Replicated activations (norms, modulation, embeddings) are computed in full
on each TP rank, as Megatron-LM does without sequence parallelism.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.device_mesh import DeviceMesh

STYLES = ("colwise", "rowwise", "colwise_gather", "gather_input", "norm_across_heads", "head_norm")


def expand_plan(root: torch.nn.Module, plan: dict[str, str]) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name, module, style)`` for every module of ``root`` a plan pattern names, in plan order. A
    pattern may match nothing (a layer some configs lack). Raises ``ValueError`` naming the pattern for
    an unknown style."""
    out = []
    modules = dict(root.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor parallel: unknown style '{style}' for '{pattern}'; known: {STYLES}")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"\Z")
        out += [(name, module, style) for name, module in modules.items() if regex.match(name)]
    return out


class ShardedRMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` over a feature dimension split into equal slices over the TP ranks (Wan's
    ``rms_norm_across_heads`` q/k norm after colwise q/k projections). ``x [..., D/tp]`` (this rank's
    slice, any float dtype) -> ``[..., D/tp]``: ``x / sqrt(mean over all D of x^2 + eps) * weight``. The
    sum of squares is all-reduced over ``mesh`` (``torch.distributed.nn.functional.all_reduce``, whose
    backward sums the slices' gradients). ``weight``: a ``Shard(0)`` DTensor of the full ``[D]`` weight,
    named like the ``RMSNorm``'s."""

    def __init__(self, norm: torch.nn.RMSNorm, mesh: DeviceMesh):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.eps = norm.eps  # None: the input dtype's eps, as torch.nn.RMSNorm
        self.full_dim = norm.normalized_shape[-1]
        self.group = mesh.get_group()
        self.weight = None
        if norm.weight is not None:
            self.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]),
                                             requires_grad=norm.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        square = x.float().pow(2).sum(-1, keepdim=True)
        mean = all_reduce(square, group=self.group) / self.full_dim
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out = (x.float() * torch.rsqrt(mean + eps)).to(x.dtype)
        return out * self.weight.to_local() if self.weight is not None else out


def gather_blocks(module: torch.nn.Module, blocks: list[int], mesh: DeviceMesh):
    """A forward pre-hook for ``module`` (left replicated) whose input is ``len(blocks)`` slices side by
    side on the last dim, each this rank's ``1/tp`` of a block of ``blocks[i]`` features: all-gathers each
    slice (:func:`pretrain.parallel.comm.gather_replicated`: the replicated consumer's gradient is the
    same on every rank, so backward keeps this rank's chunk without summing) and returns the full input.
    Returns the hook handle."""
    from pretrain.parallel.comm import gather_replicated

    group, tp = mesh.get_group(), mesh.size()

    def hook(_module, args):
        parts = args[0].split([b // tp for b in blocks], dim=-1)
        return (torch.cat([gather_replicated(p.contiguous(), -1, group) for p in parts], dim=-1), *args[1:])

    return module.register_forward_pre_hook(hook)


def _base_and_adapters(module: torch.nn.Module):
    """(base Linear, [lora_A...], [lora_B...]) of a peft ``LoraLayer``, or (module, [], [])."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module, [], []
    return base, list(module.lora_A.values()), list(module.lora_B.values())


def apply_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> int:
    """Shard ``model`` (a :class:`pretrain.backbone.Backbone` adapter, peft adapters already added, on its
    device) over the 1-D TP ``mesh`` in place with its family's plan
    (``model.tensor_parallel_plan(tp)``; see the module docstring); returns the number of layers sharded.
    Call on every rank of the TP group with identical weights, before activation checkpointing, compile
    and FSDP2 (torchtitan's order). Attention modules are left with this rank's head count
    (:func:`local_heads`) unless the adapter's ``tp_local_heads`` is False. Raises ``ValueError`` from the family (no plan, heads not divisible
    by the TP degree) or :func:`expand_plan`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh.size()
    plan = expand_plan(model.transformer, model.tensor_parallel_plan(tp))  # validates before any change
    if getattr(model, "tp_local_heads", True):
        local_heads(model.transformer, tp)
    sharded = 0
    for name, module, style in plan:
        if style == "norm_across_heads":
            if not isinstance(module, torch.nn.RMSNorm):
                continue  # no norm (Identity) is the same on every slice
            parent, _, attr = name.rpartition(".")
            setattr(model.transformer.get_submodule(parent), attr, ShardedRMSNorm(module, mesh))
        elif style == "head_norm":
            if not any(True for _ in module.parameters()):
                continue
            frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
            parallelize_module(module, mesh, SequenceParallel(sequence_dim=0, use_local_output=True))
            for n, p in module.named_parameters():  # SequenceParallel makes new, trainable Parameters
                p.requires_grad_(n not in frozen)
        elif style == "gather_input":
            base = _base_and_adapters(module)[0]  # a LoRA target's blocks sit on its base layer
            blocks = getattr(base, "_tp_packed_row_blocks", None)
            if not blocks or sum(blocks) != base.in_features or any(b % tp for b in blocks):
                raise ValueError(f"tensor parallel: '{name}' needs input blocks divisible by parallel.tp={tp} "
                                 f"summing to its {base.in_features} input features, got {blocks}")
            gather_blocks(module, blocks, mesh)
        else:
            base, lora_a, lora_b = _base_and_adapters(module)
            parallel = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                        "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate())}[style]
            parallelize_module(base, mesh, parallel())
            for adapter in (lora_a if style == "rowwise" else lora_b):
                parallelize_module(adapter, mesh, parallel())
        sharded += 1
    return sharded


def local_heads(model: torch.nn.Module, tp: int) -> None:
    """Divide ``heads`` of every attention module of ``model`` by ``tp`` (processors that reshape by
    ``attn.heads``, as SD3's and Wan's do, then see this rank's heads). Raises ``ValueError`` naming the
    module when ``tp`` does not divide its head count."""
    for name, module in model.named_modules():
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and hasattr(module, "to_q"):
            if heads % tp:
                raise ValueError(f"tensor parallel: parallel.tp={tp} does not divide the {heads} attention heads "
                                 f"of '{name}'")
            module.heads = heads // tp

