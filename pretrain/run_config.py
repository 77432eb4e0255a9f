"""The config blocks every trainer has (pretraining and each post-training stage); a trainer's config
subclasses :class:`RunConfig` and adds its own blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.data.dataset import DataConfig
from pretrain.models import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.runtime.config import CheckpointConfig, OptimConfig, RuntimeConfig, WandbConfig
from pretrain.runtime.profiling import ProfileConfig


@dataclass
class RunConfig:
    """``run_dir``: outputs go to ``<run_dir>/<stage>/``; ``model``, ``data``; ``optim`` and ``train``
    (:mod:`pretrain.runtime.config`; ``train.steps`` counts the stage's steps, and so do
    ``checkpoint.every``, the metrics ``step`` and the checkpoint folders ``step_<N>``); ``wandb``;
    ``parallel``: degrees and FSDP2 options under ``torchrun``; ``profile.steps``: steps to trace
    (``<run_dir>/<stage>/profile/``)."""

    run_dir: str = "runs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
