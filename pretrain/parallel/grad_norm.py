"""Gradient-norm clipping over parameters that live on different device meshes.

Under TP x FSDP2 the sharded layers' parameters are DTensors on the 2-D (dp_shard_sp, tp) mesh while
the rest are FSDP2 shards on the 1-D dp_shard_sp mesh; ``torch.nn.utils.clip_grad_norm_`` stacks the
per-tensor norms and refuses DTensors of different meshes. :func:`clip_grad_norm_` groups the gradients
by mesh, takes each group's 2-norm with ``torch.nn.utils.get_total_norm`` (a DTensor norm is reduced
over its mesh: ``full_tensor()``), combines them as sqrt(sum of squares), and scales every group with
``torch.nn.utils.clip_grads_with_norm_``. With one mesh (or none) it is exactly
``torch.nn.utils.clip_grad_norm_``.

Routed experts under expert parallelism (``expert.py``) live on the mesh of the ranks holding the same
experts (``dp_shard_mod_ep``); the other EP ranks hold other experts, so their squared norms are summed over
all ranks (each counted once: divided by the size of the mesh whose ranks all report it)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from pretrain.parallel.expert import EXPERT_SHARD_DIM


def _mesh_key(p: torch.Tensor):
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names, mesh.mesh.shape)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` in place to a total 2-norm of at most ``max_norm`` (``inf``: only
    measure) and return the total norm before clipping, a float32 0-dim plain tensor (the same on every
    rank of the meshes involved; NaN / inf when a gradient is non-finite)."""
    params = [p for p in params if p.grad is not None]
    groups: dict = defaultdict(list)
    for p in params:
        groups[_mesh_key(p)].append(p)
    experts = [key for key in groups if key is not None and EXPERT_SHARD_DIM in (key[1] or ())]
    if len(groups) <= 1 and not experts:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    squares = []
    for key, group in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        square = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().square()
        if key in experts:  # every rank reports its own experts' norm, each shared by the mesh's ranks
            dist.all_reduce(square)
            square = square / len(key[0])
        squares.append(square)
    total = torch.stack(squares).sum().sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
