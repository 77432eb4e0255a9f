"""Context parallelism with diffusers' own plans (``_cp_plan`` of ``FluxTransformer2DModel``,
``Flux2Transformer2DModel``, ``WanTransformer3DModel`` and ``QwenImageTransformer2DModel``, diffusers
0.42): the plan's hooks split the token sequence over the CP ranks at the model's input (FLUX and FLUX.2:
image and text tokens and their rotary ids; Wan: the patchified video tokens and the rotary tables, text
kept whole; Qwen-Image: image and text tokens, the text mask and the rotary tables), attention runs as
diffusers' Ulysses attention (``TemplatedUlyssesAttention``: all-to-all from tokens to heads and back,
DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509, with its backward), and the output projection's
tokens are all-gathered (backward: this rank's chunk, not summed). So the model takes and returns full
tensors on every CP rank, each rank back-propagates its tokens' share, and FSDP2 sums the parameter
gradients over the CP ranks (``fsdp.py``), which equals one process.

``ModelMixin.enable_parallelism`` does the same but picks its device from ``torch.accelerator`` (none on
a CPU box, so gloo runs fail there); :func:`enable_context_parallel` makes the same calls with the CP
view of this project's mesh, so one code path serves CPU tests and GPU runs. Ring attention (the
other diffusers CP attention) needs an attention backend that returns the log-sum-exp, which the CPU's
native SDPA does not; it is not offered.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


def _name_bad_splits(transformer: torch.nn.Module, cp: int) -> None:
    """Make a forward whose inputs the plan cannot split evenly raise ``ValueError`` naming ``parallel.cp``
    and the inputs' shapes: diffusers only asserts (``EquipartitionSharder.shard``), from whichever hook
    splits first (Wan's rotary tables, FLUX's tokens)."""
    forward = transformer.forward  # diffusers' hooked forward

    def checked(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except AssertionError as e:
            if "divisible by mesh size" not in str(e):
                raise
            named = [*((f"arg {i}", a) for i, a in enumerate(args)), *kwargs.items()]
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in named if isinstance(v, torch.Tensor))
            raise ValueError(f"context parallel: parallel.cp={cp} does not divide the tokens of an input "
                             f"{type(transformer).__name__}'s plan splits ({shapes})") from None

    transformer.forward = checked


def enable_context_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Install the denoiser's diffusers context-parallel plan on ``model`` (a
    :class:`pretrain.backbone.Backbone` adapter whose ``transformer`` has a ``_cp_plan``) over ``mesh``, a
    2-D ``("ring", "ulysses")`` view of the CP ranks with ring size 1 (:meth:`Mesh.cp_mesh
    <pretrain.parallel.dims.Mesh.cp_mesh>`). Call on every CP rank before FSDP2. Raises ``ValueError``
    naming the class when the denoiser has no plan or its attention backend does not support context
    parallelism, naming ``num_attention_heads`` when the CP degree does not divide it, and (at a forward)
    naming ``parallel.cp`` and the inputs' shapes when it does not divide a token count the plan splits."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig as DiffusersParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    transformer = model.transformer
    plan = getattr(type(transformer), "_cp_plan", None)
    if not plan:
        raise ValueError(f"context parallel: {type(transformer).__name__} has no diffusers _cp_plan (FLUX, FLUX.2, Wan "
                         f"and Qwen-Image have one; SD3 uses parallel.sp)")
    cp = mesh["ulysses"].size()
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads and heads % cp:
        raise ValueError(f"context parallel: parallel.cp={cp} does not divide num_attention_heads={heads}")
    config = DiffusersParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=cp))
    config.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), torch.device(mesh.device_type),
                 mesh=mesh)
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_parallel_config"):
            continue
        backend = (AttentionBackendName(processor._attention_backend) if processor._attention_backend
                   else _AttentionBackendRegistry.get_active_backend()[0])
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ValueError(f"context parallel: the attention backend '{getattr(backend, 'value', backend)}' of "
                             f"{type(processor).__name__} does not support context parallelism")
        processor._parallel_config = config
    transformer._parallel_config = config
    apply_context_parallel(transformer, config.context_parallel_config, plan)
    _name_bad_splits(transformer, cp)
