"""The blocks every post-training stage's config has; a stage's config subclasses :class:`StageConfig`
and adds its own (``rollout`` / ``grpo`` for GRPO, ``dpo`` / ``offline`` / ``online`` for DPO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.base.guard import GuardConfig
from posttrain.base.compile import CompileConfig
from posttrain.base.policy import PolicyConfig
from pretrain.run_config import RunConfig


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
class StageConfig(RunConfig):
    """The shared blocks (:class:`pretrain.run_config.RunConfig`) plus ``policy`` (LoRA or full),
    ``eval`` and ``perf``. ``model.pretrained``: an export folder (from `posttrain pretrain` or a
    previous stage) or a diffusers pipeline folder of a known family; the other ``model`` fields and
    ``data.size`` come from it. What a step is: the stage's docs. ``perf``: speed options that leave
    the numbers unchanged: ``perf.compile`` here (:class:`posttrain.base.compile.CompileConfig`), GRPO's own
    further options in :class:`posttrain.grpo.perf.PerfConfig`. ``guard``: the reward-hacking guard
checked while the stage runs (:class:`posttrain.base.guard.GuardConfig`; off by default)."""

    run_dir: str = "runs/stage"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    eval: StageEvalConfig = field(default_factory=StageEvalConfig)
    perf: CompileConfig = field(default_factory=CompileConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def validate(self, prefix: str = "") -> None:
        if not self.model.pretrained:
            raise ValueError("model.pretrained: required (an export folder written by `posttrain pretrain`)")
