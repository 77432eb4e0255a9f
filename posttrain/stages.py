"""Registry of trainable stages: command name -> (Config dataclass, train function).

A new algorithm registers one entry here; the CLI and the pipeline runner need no other change.
Every train function takes its config and returns the export folder it wrote (a data stage, which
writes a dataset, returns the export it was given, so a pipeline continues from it).
"""

from __future__ import annotations

from typing import Callable


def _pretrain():
    from pretrain.trainer import PretrainConfig, train

    return PretrainConfig, train


def _grpo():
    from posttrain.grpo import GRPOConfig, train

    return GRPOConfig, train


def _dpo():
    from posttrain.dpo import DPOConfig, train

    return DPOConfig, train


def _midtrain():
    from posttrain.midtrain import MidtrainConfig, train

    return MidtrainConfig, train


def _curate():
    from posttrain.curate import CurateConfig, curate

    return CurateConfig, curate


STAGES: dict[str, Callable[[], tuple[type, Callable]]] = {"pretrain": _pretrain, "grpo": _grpo, "dpo": _dpo,
                                                          "midtrain": _midtrain, "curate": _curate}
#: Stages that write a dataset (``<run_dir>/<command>/data``), not a model: in a pipeline the next stage
#: continues from the export before them, and a later stage reads their data with ``data_from``.
DATA_STAGES = {"curate"}


def has_checkpoints(schema: type) -> bool:
    """Whether a stage's config has a ``checkpoint`` block (``--resume`` applies); a data stage has none
    (it reuses an identical earlier output instead)."""
    from dataclasses import fields

    return any(f.name == "checkpoint" for f in fields(schema))


def get_stage(command: str) -> tuple[type, Callable]:
    """(Config class, train function) for ``command``; ``ValueError`` naming the known stages."""
    if command not in STAGES:
        raise ValueError(f"unknown stage '{command}'; known: {sorted(STAGES)}")
    return STAGES[command]()


def _grpo_run():
    from posttrain.grpo import GRPORun

    return GRPORun


def _dpo_run():
    from posttrain.dpo import DPORun

    return DPORun


def _midtrain_run():
    from posttrain.midtrain import MidtrainRun

    return MidtrainRun


#: The post-training stages a sweep can drive step by step: command -> stage-object class
#: (:mod:`pretrain.runtime.loop`'s protocol, plus ``st`` (:class:`posttrain.stage.PolicyStage`) and ``rt``).
RUNS: dict[str, Callable[[], type]] = {"grpo": _grpo_run, "dpo": _dpo_run, "midtrain": _midtrain_run}


def get_run(command: str, key: str = "command") -> type:
    """The stage-object class of post-training stage ``command``; ``ValueError`` naming ``key``."""
    if command not in RUNS:
        raise ValueError(f"{key}: '{command}' cannot be swept; known: {sorted(RUNS)}")
    return RUNS[command]()
