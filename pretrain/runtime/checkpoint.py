"""Atomic training-state checkpoints with torch.distributed.checkpoint (DCP), single process included.

Layout: ``<run>/checkpoints/step_<N>/`` (a DCP folder, N the stage's step: see each stage's docs, plus
``shape.json``, the run settings a resume must keep, and ``manifest.json``, the size and SHA-256 of
every file). A checkpoint is written to ``.tmp_step_<N>/``, its manifest computed from the written
files, and renamed only once complete, so a crash mid-write never leaves a ``step_<N>`` folder that
does not load; ``latest()`` ignores temp folders. A full disk or a refused write is one line
(:class:`pretrain.runtime.storage.StorageError`): the temp folder is removed, never renamed. ``verify()`` re-hashes a checkpoint against its
manifest (bit rot, a truncated copy, a hand-edited shard), spreading the files over the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from pretrain.runtime.storage import guarded_write

_STEP = re.compile(r"^step_(\d+)$")
SHAPE = "shape.json"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint to resume from: the message names each checkpoint tried and why it failed."""


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """SHA-256 hex digest of the file at ``path`` (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_shared(folder: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of ``names`` in ``folder``, each rank hashing every world-th file
    and all ranks receiving the union (collective under a process group)."""
    rank, world = _world()
    mine = {n: {"bytes": (folder / n).stat().st_size, "sha256": file_digest(folder / n)} for n in names[rank::world]}
    if world == 1:
        return mine
    parts = [None] * world
    torch.distributed.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def rng_state() -> dict:
    """Every global RNG state: python, numpy, torch CPU and (if present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


#: the key of ``shape.json`` that records the world size a checkpoint was written by
WORLD = "world size (torchrun --nproc_per_node x --nnodes)"


def per_rank(value, saved_world: int | None = None):
    """Wrap state that differs per rank (RNG, data positions) as ``{"rank<N>": value}`` under a process
    group of more than one rank: DCP stores one copy of the state all ranks save under the same key.
    Returned unchanged in one process (the single-process layout stays as it was). ``saved_world``: as a
    template to load a checkpoint written by that many processes: when it is not this run's world size,
    every rank reads rank 0's entry (unwrapped when it was one process)."""
    rank, world = _world()
    written = world if saved_world is None else saved_world
    if written == 1:
        return value
    return {f"rank{rank if written == world else 0}": value}


def own_rank(saved, saved_world: int | None = None):
    """This rank's entry of state written by ``per_rank`` (rank 0's when ``saved_world``, the world size
    that wrote it, is not this run's)."""
    rank, world = _world()
    written = world if saved_world is None else saved_world
    if written == 1:
        return saved
    return saved[f"rank{rank if written == world else 0}"]


class CheckpointManager:
    """Save / find / load DCP checkpoints under ``root`` and keep the last ``keep_last``."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (_STEP.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m and (self.root / m.group(0) / ".metadata").is_file())

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def save(self, step: int, state: dict, shape: dict | None = None) -> Path:
        """Write ``state`` (nested dict of tensors / picklable objects) as ``step_<step>``, with the run's
        ``shape`` (``{dotted config key: value}``, what a resume must not change) in ``shape.json``."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}"
        latest = self.latest()
        kept = f"the newest checkpoint stays {latest}" if latest else "no earlier checkpoint was touched"
        with guarded_write("checkpoint", final, tmp, kept):
            self._write(step, state, shape, final, tmp)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank looks for the checkpoint before rank 0 has renamed it
        return final

    def _write(self, step: int, state: dict, shape: dict | None, final: Path, tmp: Path) -> None:
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
            if shape:
                (tmp / SHAPE).write_text(json.dumps(shape, indent=1, sort_keys=True))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp))
        files = _hash_shared(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST))
        if _is_rank0():
            _write_synced(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()

    @staticmethod
    def verify(path: str | Path) -> str | None:
        """Check the checkpoint at ``path`` against its ``manifest.json``: None when every listed file has
        its recorded size and SHA-256, else the first problem (a file missing, short, or with another
        digest) as a phrase naming the file. A checkpoint without a manifest (written before manifests
        existed) passes. Collective under a process group (every rank gets the same answer)."""
        path = Path(path)
        listed = path / MANIFEST
        if not listed.is_file():
            return None
        try:
            want = json.loads(listed.read_text())["files"]
        except (ValueError, KeyError, TypeError) as e:
            return f"{MANIFEST} is unreadable ({type(e).__name__})"
        missing = [n for n in sorted(want) if not (path / n).is_file()]
        if missing:
            return f"{missing[0]} is missing"
        short = [n for n in sorted(want) if (path / n).stat().st_size != want[n]["bytes"]]
        if short:
            n = short[0]
            return f"{n} has {(path / n).stat().st_size} bytes, the manifest says {want[n]['bytes']}"
        got = _hash_shared(path, sorted(want))
        bad = [n for n in sorted(want) if got[n]["sha256"] != want[n]["sha256"]]
        return f"{bad[0]} does not match its SHA-256 in {MANIFEST}" if bad else None

    @staticmethod
    def written_world(path: str | Path) -> int:
        """The world size that wrote the checkpoint at ``path`` (from ``shape.json``; 1 when unrecorded)."""
        recorded = Path(path) / SHAPE
        return int(json.loads(recorded.read_text()).get(WORLD, 1)) if recorded.is_file() else 1

    @staticmethod
    def check_shape(path: str | Path, shape: dict) -> None:
        """``ConfigError`` naming the key and both values when the checkpoint at ``path`` was written by a
        run of another shape (group size, LoRA rank, world size, ...); checkpoints without a recorded
        shape pass."""
        from pretrain.config import ConfigError

        recorded = Path(path) / SHAPE
        if not recorded.is_file():
            return
        saved = json.loads(recorded.read_text())
        for key, value in shape.items():
            if key in saved and saved[key] != value:
                raise ConfigError(f"{key}: the checkpoint {path} was written with {saved[key]!r}, this run has "
                                  f"{value!r}; resume with the same {key} or start a new run_dir")

    def load(self, state: dict, path: str | Path) -> None:
        """Load ``path`` into the template ``state`` in place (same keys as when saved)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))

    @staticmethod
    def holds(path: str | Path, key: str) -> bool:
        """Whether the checkpoint at ``path`` has top-level entry ``key`` (read from DCP's metadata)."""
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return any(k == key or k.startswith(f"{key}.") for k in keys)

    def candidates(self) -> list[Path]:
        """Complete checkpoints, newest first (what a resume tries, in order)."""
        return [self.root / f"step_{s}" for s in reversed(self.steps())]

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.root / f"step_{step}", ignore_errors=True)
        for stale in self.root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
