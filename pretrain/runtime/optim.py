"""Optimizer and LR schedule construction."""

from __future__ import annotations

import math

import torch

from pretrain.runtime.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable ``params``. Raises ``ValueError`` if none require grad."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` (first step at 1/warmup), then constant or cosine to ``min_lr_ratio``."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"optim.schedule: unknown schedule '{cfg.schedule}' (known: constant, cosine)")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    lr_factor(0, total_steps, cfg)  # validate the schedule name up front
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
