"""Rank-free seeding: every random draw is keyed by (seed, step, global sample index, stream).

Convention: generators are never seeded by rank, so 1 process and N processes draw the
same noise for the same sample, and a resumed run reproduces the uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import torch

# Named streams keep independent draws for the same sample apart (noise vs. sigma vs. dropout).
STREAMS = {"train": 0, "eval": 1, "sample": 2, "data": 3, "rollout": 4, "init": 5, "shuffle": 6, "window": 7, "forward": 8, "data_loss": 9,
           "data_loss_images": 10}


def seed_for(seed: int, *keys: int | str) -> int:
    """A 63-bit seed derived from ``seed`` and integer/string keys by numpy's SeedSequence.

    Strings are mapped through ``STREAMS`` (unknown names raise ``KeyError``). The result is
    independent of process, rank and platform.
    """
    ints = [int(seed)] + [STREAMS[k] if isinstance(k, str) else int(k) for k in keys]
    if any(i < 0 for i in ints):
        raise ValueError(f"seed keys must be non-negative, got {ints}")
    state = np.random.SeedSequence(ints).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def generator_for(seed: int, *keys: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded by :func:`seed_for`."""
    g = torch.Generator(device=device)
    g.manual_seed(seed_for(seed, *keys))
    return g


def randn_per_sample(
    shape: tuple[int, ...], seed: int, step: int, indices: list[int] | range, stream: str = "train",
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normal noise ``[len(indices), *shape]``, sample ``i`` drawn from its own generator
    keyed by (seed, stream, step, global index ``indices[i]``). Drawn on CPU, then moved, so CPU and
    GPU runs draw identical noise."""
    out = [torch.randn(shape, generator=generator_for(seed, stream, step, int(i))) for i in indices]
    return torch.stack(out).to(device=device, dtype=dtype)
