"""Parsing ``rewards:`` config entries into ``RewardSpec`` (name, weight, factory parameters).

An entry is ``name: weight`` (a number) or ``name: {weight: w, <parameters>}`` (``weight`` defaults to
1.0 in the mapping form). ``name`` is a registered reward or an import path ``pkg.module:attr``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True)
class RewardSpec:
    """One parsed ``rewards:`` entry: ``name`` (registered or ``pkg.module:attr``), ``weight`` and the
    ``params`` passed to its factory."""

    name: str
    weight: float
    params: dict = field(default_factory=dict)


def is_import_path(name: str) -> bool:
    """True for names with a colon, meant as ``pkg.module:attr`` (checked by ``check_import_path``)."""
    return ":" in name


def check_import_path(name: str, key: str = "rewards") -> tuple[str, str]:
    """``(module, attr)`` of ``pkg.module:attr``; ``ValueError`` naming ``key.name`` otherwise."""
    if not _IMPORT_PATH.match(name):
        raise ValueError(f"{key}.{name}: an import path must look like 'pkg.module:attr'")
    module, attr = name.split(":", 1)
    return module, attr


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: the weight must be a number, got {value!r}")
    return float(value)


def parse_reward_spec(name: str, value: Any, key: str = "rewards") -> RewardSpec:
    """``(name, number | mapping)`` -> ``RewardSpec``; ``ValueError`` naming ``key.name`` for a value
    that is neither a number nor a mapping, a non-numeric weight, or a parameter name that is not a
    string."""
    where = f"{key}.{name}"
    if isinstance(value, Mapping):
        params = dict(value)
        weight = _number(params.pop("weight", 1.0), f"{where}.weight")
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{where}: parameter names must be strings, got {bad}")
        return RewardSpec(name, weight, params)
    return RewardSpec(name, _number(value, where))


def parse_reward_specs(config: Mapping[str, Any], key: str = "rewards") -> dict[str, RewardSpec]:
    """A whole ``rewards:`` mapping -> ``{name: RewardSpec}`` (order kept); ``ValueError`` naming the
    entry, as ``parse_reward_spec``, or ``key`` when ``config`` is not a mapping."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{key}: expected a mapping {{name: weight}} or {{name: {{weight: w, ...}}}}, "
                         f"got {type(config).__name__}")
    return {str(name): parse_reward_spec(str(name), value, key) for name, value in config.items()}
