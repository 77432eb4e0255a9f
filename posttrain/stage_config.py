"""The blocks every post-training stage's config has; a stage's config subclasses :class:`StageConfig`
and adds its own (``rollout`` / ``grpo`` for GRPO, ``dpo`` / ``offline`` / ``online`` for DPO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.perf import PerfConfig
from posttrain.policy import PolicyConfig
from pretrain.data.dataset import DataConfig
from pretrain.models import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.runtime.config import CheckpointConfig, OptimConfig, RuntimeConfig, WandbConfig
from pretrain.runtime.profiling import ProfileConfig


@dataclass
class StageEvalConfig:
    """Held-out evaluation every ``every`` stage steps (0 = only at the end; GRPO writes a grid, DPO
    measures offline pairs' implicit accuracy) and the final grid of ``grid_prompts`` held-out prompts,
    sampled with the deterministic ODE at ``num_inference_steps`` and ``guidance_scale``."""

    every: int = 0
    grid_prompts: int = 16
    num_inference_steps: int = 20
    guidance_scale: float = 4.0


@dataclass
class StageConfig:
    """``run_dir``: outputs go to ``<run_dir>/<stage>/``. ``model.pretrained``: an export folder (from
    `posttrain pretrain` or a previous stage) or a diffusers pipeline folder of a known family; the
    other ``model`` fields and ``data.size`` come from it. ``train.steps`` counts the stage's steps
    (what a step is: the stage's docs; ``checkpoint.every``, the metrics ``step`` and the checkpoint
    folder names count the same steps). ``perf``: speed options that leave the numbers unchanged
    (:class:`posttrain.perf.PerfConfig`); ``profile.steps``: steps to trace (``<run>/<stage>/profile/``);
    ``parallel``: degrees and FSDP2 options under ``torchrun``."""

    run_dir: str = "runs/stage"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: StageEvalConfig = field(default_factory=StageEvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self, prefix: str = "") -> None:
        if not self.model.pretrained:
            raise ValueError("model.pretrained: required (an export folder written by `posttrain pretrain`)")
