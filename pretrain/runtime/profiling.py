"""The profiler switch: ``profile.steps=[...]`` records those steps (or GRPO iterations) with
``torch.profiler`` and writes a Chrome trace plus a memory summary into ``<run>/profile/``."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class ProfileConfig:
    """``steps``: 1-based step (or iteration) numbers to profile; empty = off."""

    steps: list[int] = field(default_factory=list)

    def validate(self, prefix: str = "") -> None:
        bad = [s for s in self.steps if s < 1]
        if bad:
            raise ValueError(f"{prefix}steps: step numbers start at 1, got {bad}")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepProfiler:
    """``with profiler.step(n): ...`` profiles step ``n`` if configured and writes
    ``step_<n>.trace.json`` (Chrome trace format: open in chrome://tracing or Perfetto) and
    ``step_<n>_memory.txt`` (operators by self memory, peak RSS, CUDA peak) to ``out_dir``."""

    def __init__(self, cfg: ProfileConfig, out_dir: str | Path):
        self.steps, self.out = set(cfg.steps), Path(out_dir)

    @contextlib.contextmanager
    def step(self, n: int):
        if n not in self.steps:
            yield None
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.out.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with profile(activities=acts, record_shapes=True, profile_memory=True) as prof:
            yield prof
        prof.export_chrome_trace(str(self.out / f"step_{n}.trace.json"))
        lines = [f"peak RSS so far: {peak_rss_mb():.1f} MiB"]
        if torch.cuda.is_available():
            lines.append(f"CUDA peak allocated in this step: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
        lines.append(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=30))
        (self.out / f"step_{n}_memory.txt").write_text("\n".join(lines) + "\n")
