"""Process groups: join the one ``torchrun`` describes (``init_distributed``), or start a few local
CPU ranks joined by gloo for tests and benchmarks (``run_ranks``)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

#: what the fork server of :func:`run_ranks` imports once, before it forks the ranks
PRELOAD = ["torch", "torch.distributed", "diffusers", "diffusers.models", "peft", "transformers", "pretrain.trainer",
           "posttrain.grpo.stage"]


def _launcher_processes(pid: int) -> int | None:
    """``--num_processes`` of an ``accelerate launch`` command line of process ``pid`` (None: not one)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "launch" not in argv or not any(a.endswith("accelerate") or a == "accelerate.commands.launch" for a in argv):
        return None
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--num_processes" and i + 1 < len(argv) else a.partition("=")[2] \
            if a.startswith("--num_processes=") else None
        if value and value.isdigit():
            return int(value)
    return None


def launched_world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``, set by ``torchrun`` and by
    ``accelerate launch --multi_gpu``), 1 without one: known before any process group or model, so a
    config check can refuse what cannot run under it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launcher() -> None:
    """``ConfigError`` when ``accelerate launch --cpu --num_processes N`` (N > 1) started this process
    alone: accelerate's ``--cpu`` launcher starts one process (its multi-CPU mode needs MPI), so the
    job would silently run on one rank. ``accelerate launch --multi_gpu --num_processes N`` starts N
    ranks through torchrun (gloo on CPU, NCCL on GPUs) and is accepted, as is ``torchrun``."""
    from pretrain.config import ConfigError

    if "WORLD_SIZE" in os.environ or os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1"):
        return
    n = _launcher_processes(os.getppid())
    if n and n > 1:
        raise ConfigError(f"accelerate launch --cpu --num_processes {n} starts one process, not {n}: use "
                          f"`accelerate launch --multi_gpu --num_processes {n} -m posttrain ...` (on CPU too: "
                          f"it starts {n} gloo ranks through torchrun) or `torchrun --nproc_per_node {n} -m "
                          f"posttrain ...`")


def _attempt_store(timeout: timedelta):
    """``(store, rank, world_size)`` of the ``env://`` rendezvous, the store prefixed by the torchrun
    attempt: after ``torchrun --max-restarts`` restarts the ranks, the agent's store still holds the
    previous attempt's keys (gloo's peer addresses among them), which a new group would read."""
    from torch.distributed import PrefixStore, rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    return PrefixStore(f"posttrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store), rank, world


def init_distributed(timeout_s: float = 1800.0, dump_dir: str | Path | None = None) -> torch.device:
    """Under ``torchrun`` (``WORLD_SIZE`` set; ``accelerate launch --multi_gpu`` sets it the same way):
    initialise the default process group (NCCL with CUDA, gloo otherwise) from its environment
    variables and return this rank's device (``cuda:LOCAL_RANK`` or cpu). Without it: nothing to
    join, returns the default device. ``ConfigError`` from :func:`check_launcher`.

    ``timeout_s``: how long a collective may wait before the group aborts (seconds). On CUDA the NCCL
    flight recorder is switched on unless the environment already sets it
    (:func:`flight_recorder_env`; dumps to ``dump_dir``, default ``./flight_recorder``)."""
    check_launcher()
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            for key, value in flight_recorder_env(dump_dir or "flight_recorder", os.environ).items():
                os.environ[key] = value
                if key == "TORCH_FR_DUMP_TEMP_FILE":
                    Path(value).parent.mkdir(parents=True, exist_ok=True)
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = _attempt_store(timeout)
        torch.distributed.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                             timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def flight_recorder_env(dump_dir: str | Path, environ) -> dict[str, str]:
    """The NCCL flight-recorder settings to add to ``environ`` (only the keys it does not set): a ring
    of the last 2000 collectives per rank (``TORCH_FR_BUFFER_SIZE``), dumped when a collective times out
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to ``<dump_dir>/rank_<N>`` (``TORCH_FR_DUMP_TEMP_FILE``; read them
    with ``python -m torch.distributed.flight_recorder.fr_trace <dump_dir>``). See docs/doctor.md."""
    defaults = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_FR_DUMP_TEMP_FILE": str(Path(dump_dir).resolve() / "rank_")}
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:  # the older name of the buffer size
        defaults.pop("TORCH_FR_BUFFER_SIZE")
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in environ:
        defaults.pop("TORCH_FR_DUMP_TEMP_FILE")
    return {k: v for k, v in defaults.items() if k not in environ}


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args: tuple, env: dict) -> None:
    os.environ.clear()  # the caller's environment at the launch, not the fork server's at its start
    os.environ.update(env)
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local CPU processes joined by gloo (a free
    localhost port, one thread each: ``OMP_NUM_THREADS=1``, the caller's environment otherwise) and
    return every rank's return value (anything ``torch.save`` writes) in rank order, so a test asserts in
    the parent. The processes are forked from a ``multiprocessing`` fork server that imported torch,
    diffusers and peft once (:data:`PRELOAD`), so a launch does not pay their import in every rank.
    ``fn`` must be importable (module level) and ``args`` picklable. An exception in a rank is re-raised
    here with that rank's traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world_size, free_port(), out, fn, args, env), nprocs=world_size, join=True,
                           start_method="forkserver")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
