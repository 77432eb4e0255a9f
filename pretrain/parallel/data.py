"""Spreading a step's samples over the data-parallel ranks and gathering per-sample results back.

Rank-free rule (DESIGN.md): every rank draws the same prompt list from the same seeded sampler, takes a
contiguous share (``shard_bounds``), and keys each sample's noise by its **global** index, so N ranks
draw exactly what one process draws. Per-sample results (rewards, group ids) are gathered in rank order
(``gather_samples``), which is the single-process order, so statistics over groups that span ranks
(GRPO advantages) are computed on the same numbers as in one process; each rank then keeps its share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_bounds(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous equal share of ``total`` items over ``size`` ranks.
    Raises ``ValueError`` naming both numbers unless ``size`` divides ``total``."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_bounds: rank {rank} is not in [0, {size})")
    if total % size:
        raise ValueError(f"shard_bounds: {total} items do not split evenly over {size} data-parallel ranks")
    share = total // size
    return rank * share, (rank + 1) * share


@torch.no_grad()
def gather_samples(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``local [n, ...]`` along dim 0 in rank order (no gradient; NaN kept).
    Every rank must pass the same shape and dtype. Without a process group, returns ``local``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)
