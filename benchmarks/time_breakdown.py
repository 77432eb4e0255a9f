"""Where an iteration's time goes: one profiled iteration's operator time by kernel class, next to the
floor each class's counted FLOPs put under it (:func:`benchmarks.kernel_rates.floor_by_class`).

The classes (:func:`benchmarks.kernel_rates.kernel_class`): attention forward / backward, GEMMs,
convolutions (the kernels the floor counts), then the work the floor leaves out: inductor's fused
elementwise kernels (named ``graph_<n>_cpp_fused_...`` once
``torch._inductor.config.cpp.enable_kernel_profile`` is on before compiling), the other ATen ops run
eagerly (copies, elementwise ops, norms of uncompiled code), framework events (autograd engine, dynamo
guards, compiled-graph calls, the optimizer's step: their self time) and the wall time outside any
recorded op (Python). Self times come from ``torch.profiler`` (CPU activity), which adds its own
overhead to every op, most to the many small ones; ops of other Python threads (a scoring thread) are
counted too and can overlap the main thread's.
"""

from __future__ import annotations

import time
from typing import Callable

from benchmarks.kernel_rates import FLOOR_CLASSES, kernel_class

OUTSIDE = "outside any op"
CLASSES = (*FLOOR_CLASSES, "fused elementwise (compiled)", "eager ATen ops", "framework", OUTSIDE)


def enable_kernel_names() -> None:
    """Make inductor's generated CPU kernels record profiler events under their own names (must run
    before anything is compiled; it changes the generated code, so a timed row must not use it)."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


def profiled_breakdown(step: Callable[[], object]) -> dict[str, float]:
    """Run ``step`` once under ``torch.profiler``; returns seconds per class of :data:`CLASSES` and
    ``"wall"`` (the step's wall time). :data:`OUTSIDE` is the wall time no recorded op accounts for
    (0 when overlapping threads' ops add up to more than the wall time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    return breakdown_of_events(((ev.key, ev.self_cpu_time_total) for ev in prof.key_averages()), wall)


def breakdown_of_events(events, wall: float) -> dict[str, float]:
    """``events``: (profiler event name, self CPU time in microseconds) pairs; ``wall``: seconds.
    Returns seconds per class of :data:`CLASSES` and ``"wall"``."""
    out = dict.fromkeys(CLASSES, 0.0)
    for name, self_us in events:
        out[kernel_class(name)] += self_us / 1e6
    out[OUTSIDE] = max(wall - sum(out.values()), 0.0)
    return {**out, "wall": wall}
