"""Restarts under ``torchrun --max-restarts N``: when a rank dies, torchrun's agent stops the other ranks
and starts the whole group again with ``TORCHELASTIC_RESTART_COUNT`` one higher. A restarted rank
resumes from the last complete checkpoint on its own (:func:`restart_count` > 0 makes the runtime
resume), and the run folder says how many restarts happened and why:

- ``attempts/<job>/restart_<n>/rank_<r>.json``: each rank's record of attempt ``n`` of torchrun job
  ``<job>`` (``TORCHELASTIC_RUN_ID``): host, pid, start time, the optimizer step it was last seen at
  (written at most every 10 s and at each checkpoint) and the stage step of the last checkpoint it wrote, and how it ended: ``finished``, ``failed`` with the error line,
  ``terminated`` (torchrun's SIGTERM to the survivors once a rank failed), or still ``running`` (it
  ended without a Python error: killed, ``os._exit``, a segfault, the OOM killer).
- ``restarts.jsonl``: one line per restart, written by rank 0 of the new attempt: the job, the restart
  number, the time, the checkpoint resumed from and ``why`` (each rank of the previous attempt that did
  not finish, with how it ended: silent deaths first, then Python errors, then ranks torchrun stopped).

Outside ``torchrun`` (no ``TORCHELASTIC_RESTART_COUNT``) nothing is recorded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun restarted this job's ranks (0 on the first attempt and outside torchrun)."""
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def ended(record: dict) -> str:
    """One line on how a rank's attempt ended, from its record."""
    where = f"rank {record['rank']} (host {record['host']}, pid {record['pid']})"
    step = f"(last seen at optimizer step {record['step']}" + (f", last checkpoint step_{record['checkpoint']}"
                                              if record.get("checkpoint") is not None else ", no checkpoint yet") + ")"
    if record["status"] == "failed":
        return f"{where} failed {step}: {record.get('error', '')}"
    if record["status"] == "terminated":
        return f"{where} was stopped by torchrun (SIGTERM) after another rank failed {step}"
    return f"{where} ended without a Python error: killed, os._exit, a crash or the OOM killer {step}"


class Attempt:
    """This rank's record of the current torchrun attempt of the run in ``run`` (a stage folder);
    inert outside torchrun. ``progress(step)`` is cheap (a write at most every ``every_s`` seconds)."""

    def __init__(self, run: str | Path, rank: int, every_s: float = 10.0):
        self.enabled = RESTART_ENV in os.environ
        self.run, self.rank, self.every_s = Path(run), rank, every_s
        self.job = os.environ.get("TORCHELASTIC_RUN_ID", "job") or "job"
        self.restart = restart_count()
        self.path = self.run / "attempts" / self.job / f"restart_{self.restart}" / f"rank_{rank}.json"
        self.record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": _now(),
                       "status": "running", "step": 0, "checkpoint": None}
        self._written = 0.0

    def begin(self, step: int, resumed_from: str | Path | None) -> str | None:
        """Record the start at ``step``; on rank 0 of a restart, append the restart and its reasons to
        ``restarts.jsonl`` and return its one-line summary (None otherwise)."""
        if not self.enabled:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress(step, force=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._terminated)
        if self.restart == 0 or self.rank != 0:
            return None
        before = self.path.parent.parent / f"restart_{self.restart - 1}"
        records = [json.loads(p.read_text()) for p in sorted(before.glob("rank_*.json"))]
        first = {"running": 0, "failed": 1, "terminated": 2}  # a silent death is the likeliest first cause
        why = [ended(r) for r in sorted(records, key=lambda r: (first.get(r["status"], 3), r["rank"]))
               if r["status"] != "finished"]
        if not why:
            why = [f"no rank record of attempt {self.restart - 1} says what ended it (see torchrun's log)"]
        line = {"job": self.job, "restart": self.restart, "time": _now(),
                "resumed_from": str(resumed_from) if resumed_from else None, "why": why}
        with open(self.run / "restarts.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return (f"torchrun restart {self.restart}: resumed from {resumed_from or 'the start (no checkpoint yet)'}; "
                f"the previous attempt ended: " + "; ".join(why))

    def previous_stop(self) -> str | None:
        """The reason the previous attempt stopped on purpose (a ``RunStopped`` on some rank), or None."""
        before = self.path.parent.parent / f"restart_{self.restart - 1}"
        for path in sorted(before.glob("rank_*.json")) if self.enabled and self.restart else []:
            record = json.loads(path.read_text())
            if record.get("stopped"):
                return f"rank {record['rank']}: {record.get('error', '')}"
        return None

    def progress(self, step: int, checkpoint: int | None = None, force: bool = False) -> None:
        """Note ``step`` (and a checkpoint just written at ``checkpoint``)."""
        if not self.enabled:
            return
        self.record["step"] = step
        if checkpoint is not None:
            self.record["checkpoint"] = checkpoint
        if force or checkpoint is not None or time.monotonic() - self._written >= self.every_s:
            _write(self.path, self.record)
            self._written = time.monotonic()

    def _terminated(self, signum, frame) -> None:
        """SIGTERM (torchrun stops the other ranks once one has failed): record it, then die of it."""
        self.record.update(status="terminated", ended=_now())
        _write(self.path, self.record)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def end(self, error: BaseException | None = None) -> None:
        """Record how this attempt ended here: ``finished``, or ``failed`` with ``error``'s line."""
        if not self.enabled or not self.path.parent.is_dir():
            return
        from pretrain.runtime.guard import RunStopped

        self.record["status"] = "failed" if error is not None else "finished"
        self.record["stopped"] = isinstance(error, RunStopped)
        if error is not None:
            self.record["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
        self.record["ended"] = _now()
        _write(self.path, self.record)


def restarts_of(run: str | Path) -> list[dict]:
    """The restarts recorded in stage folder ``run`` (``restarts.jsonl``), oldest first."""
    path = Path(run) / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
