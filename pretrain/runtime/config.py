"""Config of the training runtime shared by every trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pretrain.config import require_positive
from pretrain.runtime.low_precision import LowPrecisionConfig


@dataclass
class OptimConfig:
    """AdamW (Loshchilov & Hutter 2019) with linear warm-up then ``schedule`` ("constant" or "cosine"
    down to ``min_lr_ratio * lr``); gradients clipped to ``grad_clip`` (0 = no clipping).
    ``eps_check_every``: log ``adam_eps_dominated_frac``, the share of trainable elements whose update
    ``eps`` dominates (:mod:`pretrain.runtime.adam_eps`), at optimizer step 1 and every N steps (0 = off);
    RL fine-tuning usually wants ``eps`` far below 1e-8 (docs/grpo.md)."""

    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    eps_check_every: int = 10

    def validate(self, prefix: str = "") -> None:
        if self.eps_check_every < 0:
            raise ValueError(f"{prefix}eps_check_every: must be >= 0 (0 = off), got {self.eps_check_every}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"{prefix}lr: must be a finite number > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"{prefix}schedule: '{self.schedule}' is not one of constant, cosine")
        if self.warmup_steps < 0:
            raise ValueError(f"{prefix}warmup_steps: must be >= 0")


@dataclass
class RuntimeConfig:
    """``steps``: optimizer steps; ``batch_size``: micro-batch per process; ``grad_accum``: micro-batches
    per optimizer step. ``precision``: "fp32" | "bf16" (autocast) | "fp16" (autocast + grad scaler).
    ``ema_decay``: 0 disables EMA; otherwise EMA weights are used for sampling and export.
    ``max_nonfinite``: consecutive non-finite steps tolerated before the run stops.
    ``max_no_signal`` (stages trained on rewards): iterations in a row in which every prompt group has
    zero reward spread before the run stops (0 = never; :mod:`posttrain.base.signal_guard`).
    ``spike_window`` / ``spike_zscore`` / ``spike_action``: the loss-spike detector
    (:mod:`pretrain.runtime.spikes`; window 0 = off; action ``warn`` or ``skip``).
    ``replica_check_every``: compare the data-parallel replicas' weights every N optimizer steps
    (:mod:`pretrain.parallel.replicas`; 0 = never; nothing to compare in one process).
    ``device``: "auto" (cuda if available), "cpu" or "cuda[:i]"; ``threads``: torch CPU threads.
    ``keep_freed_memory``: glibc malloc keeps freed memory for reuse instead of returning it to the kernel
    (fewer page faults, resident memory stays at its peak; :func:`pretrain.runtime.host.keep_freed_memory`);
    None = on when training on a CPU.
    ``low_precision``: FP8 / MXFP8 / NVFP4 training of the denoiser's Linear layers with torchao
    (:mod:`pretrain.runtime.low_precision`; off by default)."""

    steps: int = 100
    batch_size: int = 32
    grad_accum: int = 1
    seed: int = 0
    precision: str = "fp32"
    ema_decay: float = 0.0
    max_nonfinite: int = 3
    max_no_signal: int = 10
    spike_window: int = 100
    spike_zscore: float = 6.0
    spike_action: str = "warn"
    replica_check_every: int = 100
    device: str = "auto"
    threads: int | None = None
    keep_freed_memory: bool | None = None
    low_precision: LowPrecisionConfig = field(default_factory=LowPrecisionConfig)

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "steps", "batch_size", "grad_accum")
        self.low_precision.check_device(f"{prefix}low_precision.", self.device)
        if self.max_no_signal < 0:
            raise ValueError(f"{prefix}max_no_signal: must be >= 0 (0 = never stop), got {self.max_no_signal}")
        for name in ("spike_window", "replica_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}{name}: must be >= 0 (0 = off), got {getattr(self, name)}")
        if not self.spike_zscore > 0:
            raise ValueError(f"{prefix}spike_zscore: must be > 0, got {self.spike_zscore}")
        if self.spike_action not in ("warn", "skip"):
            raise ValueError(f"{prefix}spike_action: '{self.spike_action}' is not one of warn, skip")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"{prefix}precision: '{self.precision}' is not one of fp32, bf16, fp16")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"{prefix}ema_decay: must be in [0, 1), got {self.ema_decay}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"{prefix}device: '{self.device}' requested but no CUDA device is available")


@dataclass
class CheckpointConfig:
    """``every``: save every N steps (0 = only the final one); ``keep_last``: prune older ones;
    ``resume``: continue from the latest complete checkpoint in the run directory."""

    every: int = 0
    keep_last: int = 2
    resume: bool = False


@dataclass
class WandbConfig:
    """``mode``: "disabled", "offline" or "online"."""

    mode: str = "disabled"
    project: str = "posttrain"
    name: str | None = None

    def validate(self, prefix: str = "") -> None:
        import importlib.util

        if self.mode not in ("disabled", "offline", "online"):
            raise ValueError(f"{prefix}mode: '{self.mode}' is not one of disabled, offline, online")
        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ValueError(f"{prefix}mode: '{self.mode}' needs the package wandb, which is not installed: "
                             f"pip install 'posttrain[wandb]'")
