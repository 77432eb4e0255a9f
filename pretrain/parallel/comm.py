"""Differentiable collectives over a process group, for sequence parallelism (work with gloo and NCCL).

- ``all_to_all(x, scatter_dim, gather_dim)``: split ``x`` into ``world`` chunks along ``scatter_dim``,
  send chunk ``j`` to rank ``j``, concatenate what arrives (in rank order) along ``gather_dim``.
  Its adjoint is the all-to-all with the two dims swapped (DeepSpeed-Ulysses, Jacobs et al. 2023,
  arXiv 2309.14509).
- ``all_gather(x, dim)``: concatenate every rank's ``x`` along ``dim``; backward is the adjoint
  (reduce-scatter: sum the gradients of all ranks, keep this rank's chunk). Use it when each rank
  consumes the gathered tensor differently.
- ``gather_replicated(x, dim)``: the same forward, but backward keeps this rank's chunk of the
  gradient without summing. Use it only when every rank consumes the gathered tensor identically (a loss
  replicated on the group), so the gradients are equal on all ranks and summing would count them
  ``world`` times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by the "
                         f"group size {world}")
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sum_grads):
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return _chunk(grad, ctx.dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Differentiable all-to-all; ``x.shape[scatter_dim]`` must be divisible by the group size
    (``ValueError`` otherwise). Output: ``scatter_dim`` divided, ``gather_dim`` multiplied by the size."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's equally shaped ``x`` along ``dim``; gradients summed over ranks."""
    return _AllGather.apply(x, dim, group, True)


def gather_replicated(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` for a consumer replicated on the group; the gradient
    of this rank's chunk is taken from its own (identical) copy, not summed."""
    return _AllGather.apply(x, dim, group, False)


def split(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (``ValueError`` if the group size does not
    divide it). Plain slicing, so the gradient is zero outside the chunk."""
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by the group size {world}")
    return x.chunk(world, dim=dim)[dist.get_rank(group)]
