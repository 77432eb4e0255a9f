"""The one table of stages: command name -> :class:`Stage` (its Config class, its Run class or train
function, whether it writes data rather than a model, its help line).

A new stage registers one row (:data:`STAGES`, or ``STAGES.register(name, Stage(...))`` from code of
your own); the CLI, the pipeline runner and the sweep need no other change. Every entry is a lazy
``module:attr`` path, so listing the stages imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from pretrain.registry import Registry, import_path


@dataclass(frozen=True)
class Stage:
    """One stage. ``config``: its Config dataclass (``module:Class``); ``run``: its stage object
    (:mod:`pretrain.runtime.loop`'s protocol: constructed from the config, then stepped), None for a
    stage that is one function call; ``train``: the function ``train(cfg) -> Path`` that runs it to the
    end (the export folder; a data stage returns the export it was given, a reward stage its reward
    model's folder); ``writes``: "export" (a model the next stage continues from), "data" (a dataset,
    ``<run_dir>/<command>/data``, that a later stage reads with ``data_from``) or "reward" (a reward model,
    ``<run_dir>/<command>/model``, that a later stage names in its ``reward`` block); the next stage of a
    pipeline continues from the last export before a data or reward stage; ``source_key``: the config
    key a pipeline sets to that export; ``sweep``: a post-training stage whose Run a sweep can
    step (it has ``st``, a :class:`posttrain.base.stage.PolicyStage`, and ``rt``); ``help``: the CLI's line."""

    config: str
    train: str
    run: str | None = None
    writes: str = "export"
    sweep: bool = False
    help: str = ""
    source_key: str = "model.pretrained"

    def __post_init__(self):
        if self.writes not in ("export", "data", "reward"):
            raise ValueError(f"Stage.writes: '{self.writes}' is not one of export, data, reward")

    @property
    def data(self) -> bool:
        return self.writes == "data"

    def schema(self) -> type:
        return import_path(self.config, "stage config")

    def train_fn(self) -> Callable:
        return import_path(self.train, "stage train function")

    def run_class(self) -> type | None:
        return import_path(self.run, "stage run class") if self.run else None

    def has_checkpoints(self) -> bool:
        """Whether its config has a ``checkpoint`` block (``--resume`` applies); a data stage has none (it
        reuses an identical earlier output instead)."""
        return has_checkpoints(self.schema())


STAGES = Registry("stage", {
    "pretrain": Stage("pretrain.trainer:PretrainConfig", "pretrain.trainer:train", "pretrain.trainer:PretrainRun",
                      help="flow-matching pretraining"),
    "grpo": Stage("posttrain.grpo.stage:GRPOConfig", "posttrain.grpo.stage:train", "posttrain.grpo.stage:GRPORun", sweep=True,
                  help="Flow-GRPO post-training (and the forward-process losses NFT, AWM, DGPO)"),
    "dpo": Stage("posttrain.dpo.stage:DPOConfig", "posttrain.dpo.stage:train", "posttrain.dpo.stage:DPORun", sweep=True,
                 help="Diffusion-DPO post-training"),
    "midtrain": Stage("posttrain.midtrain.stage:MidtrainConfig", "posttrain.midtrain.stage:train",
                      "posttrain.midtrain.stage:MidtrainRun", sweep=True, help="supervised flow-matching fine-tuning of an export"),
    "reward_gradient": Stage("posttrain.reward_gradient.stage:RewardGradientConfig",
                             "posttrain.reward_gradient.stage:train", "posttrain.reward_gradient.stage:RewardGradientRun",
                             sweep=True, help="reward-gradient fine-tuning (DRaFT-K, DRaFT-LV, ReFL, AlignProp, "
                             "Adjoint Matching) on a differentiable reward"),
    "curate": Stage("posttrain.curate.stage:CurateConfig", "posttrain.curate.stage:curate", writes="data",
                    help="score a dataset with rewards, filter, drop near-duplicates (a folder dataset and a report)"),
    "cache": Stage("pretrain.data.cache_stage:CacheConfig", "pretrain.data.cache_stage:cache", writes="data",
                   help="encode a dataset once into latent + text-embedding shards (data.source: latent_cache)"),
    "train-reward": Stage("posttrain.tools.train_reward:TrainRewardConfig",
                          "posttrain.tools.train_reward:train_reward_stage",
                          writes="reward", source_key="judge.generated_from",
                          help="train a small reward model (learned_clip, or the learned_judge stand-in with "
                          "objective: judge, sampling the export before it)"),
}, key="command")


def has_checkpoints(schema: type) -> bool:
    """Whether a stage's config class has a ``checkpoint`` block (``--resume`` applies)."""
    return any(f.name == "checkpoint" for f in fields(schema))


def get_stage(command: str) -> tuple[type, Callable]:
    """(Config class, train function) for ``command``; ``ValueError`` naming the known stages."""
    stage = STAGES.get(command)
    return stage.schema(), stage.train_fn()


def get_run(command: str, key: str = "command") -> type:
    """The stage-object class of ``command`` (what a sweep steps); ``ValueError`` naming ``key`` when the
    stage has none."""
    if command not in STAGES or not STAGES[command].sweep:
        raise ValueError(f"{key}: '{command}' cannot be swept; known: {sorted(n for n in STAGES if STAGES[n].sweep)}")
    return STAGES[command].run_class()


def data_stages() -> list[str]:
    """The stages that write a dataset, not a model (in a pipeline the next stage continues from the
    export before them, and a later stage reads their data with ``data_from``)."""
    return sorted(n for n in STAGES if STAGES[n].data)


def model_stages() -> list[str]:
    """The stages that write a model export (in a pipeline the next stage continues from it; data and
    reward stages pass the export before them through)."""
    return sorted(n for n in STAGES if STAGES[n].writes == "export")


def load_stage_config(command: str, config: str, overrides: list[str]) -> tuple[Stage, object]:
    """(The stage row, its config loaded from ``config`` with ``overrides``). ``ValueError`` naming the
    known stages; ``ConfigError`` for a bad config, before anything loads."""
    from pretrain.config import load_config

    stage = STAGES.get(command)
    return stage, load_config(stage.schema(), config, overrides)


def run_command(command: str, config: str, overrides: list[str], resume: bool = False) -> tuple[object, Path]:
    """Load stage ``command``'s config (:func:`load_stage_config`) and run it to the end; ``resume`` continues
    from its latest checkpoint where it has one (and starts fresh where none exists yet). Returns (the
    loaded config, the export folder)."""
    stage, cfg = load_stage_config(command, config, overrides)
    if resume and stage.has_checkpoints():
        cfg.checkpoint.resume = True
    return cfg, stage.train_fn()(cfg)
