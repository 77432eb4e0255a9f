"""Start ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo.

``torch.multiprocessing.spawn`` with a free TCP port on localhost; ranks run with one thread
(``OMP_NUM_THREADS=1``: CI has 2 cores) and destroy their process group on exit. ``run_ranks`` returns
every rank's return value (anything ``torch.save`` can write), so the test asserts in the parent. An
exception in any rank is re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn, *args, world_size: int = 2) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and return their results in rank
    order; ``fn`` must be importable (a module-level function) and ``args`` picklable."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_entry, args=(world_size, free_port(), out, fn, args), nprocs=world_size, join=True)
            return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
