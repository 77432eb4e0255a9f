"""Process groups: join the one ``torchrun`` describes (``init_distributed``), or start a few local
CPU ranks joined by gloo for tests and benchmarks (``run_ranks``)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def init_distributed() -> torch.device:
    """Under ``torchrun`` (``WORLD_SIZE`` set): initialise the default process group (NCCL with CUDA,
    gloo otherwise) from its environment variables and return this rank's device (``cuda:LOCAL_RANK``
    or cpu). Without ``torchrun``: nothing to join, returns the default device."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


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
        # no rank closes its gloo pairs while a peer still has work in flight (a peer's teardown then
        # aborted that rank now and then: "terminate called without an active exception")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn, *args, world_size: int = 2) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local CPU processes joined by gloo
    (``torch.multiprocessing.spawn``, a free localhost port, one thread each: ``OMP_NUM_THREADS=1``) and
    return every rank's return value (anything ``torch.save`` writes) in rank order, so a test asserts in
    the parent. ``fn`` must be importable (module level) and ``args`` picklable. An exception in a rank
    is re-raised here with that rank's traceback."""
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
