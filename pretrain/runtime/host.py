"""Process-wide settings of the machine a stage runs on: torch's CPU threads and, on a CPU, glibc malloc
keeping freed memory for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit: 4 * 1024 * 1024 * sizeof(long)
_kept = False


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory in the heap for the next allocation instead of returning it to
    the kernel: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap's
    free top is never trimmed. A CPU training step frees and reallocates the same activation-sized blocks
    every forward; returned pages come back as page faults the kernel zeroes (measured on the GRPO
    benchmark: 2.0 M -> 1.3 M faults over 4 iterations, about 10 % more samples/s). Resident memory stays
    at its peak. Process-wide and not undone; a no-op returning False off Linux glibc."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _kept = ok
    return ok


def configure_host(train_cfg, device: torch.device | str) -> None:
    """``train.threads`` (torch CPU threads, when set) and ``train.keep_freed_memory`` (None = on when
    ``device`` is a CPU; :func:`keep_freed_memory`) for this process."""
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)
    keep = train_cfg.keep_freed_memory
    if keep is None:
        keep = torch.device(device).type == "cpu"
    if keep:
        keep_freed_memory()
