"""YAML -> typed dataclass configs (OmegaConf structured configs) with errors that name the key.

``load_config(Schema, path, ["a.b=1", ...])`` returns a ``Schema`` instance. An unknown key, a value of
the wrong type, a missing mandatory value or a missing/unparsable file raises ``ConfigError`` whose
message names the dotted key and the file (or "command line" for overrides); the CLI exits with 2.
An override ``~key.path`` removes a key of a free-form mapping (e.g. a registered part's option), and
``~rewards`` (a free-form mapping that is a field) empties it: ``~rewards rewards.aesthetic=1`` replaces
the file's rewards, where ``rewards={aesthetic: 1}`` alone merges into them (with a warning).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config problem; ``str()`` names the file and the dotted key."""


def _describe(e: OmegaConfBaseException, schema: type | None = None) -> str:
    """The error naming its dotted key; with the key in ``schema.moved_keys`` (``{old: new}``, a class
    attribute of a config that renamed keys), a hint naming the new key."""
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = getattr(e, "msg", None) or str(e).splitlines()[0]
    msg = msg.splitlines()[0]
    moved = getattr(schema, "moved_keys", {}).get(key)
    msg += f" (it moved to '{moved}')" if moved else ""
    return f"key '{key}': {msg}" if key else msg


@functools.cache
def _schema_defaults(schema: type):
    """``OmegaConf.structured(schema)``, built once per class (it walks every nested dataclass: about 0.1 s
    for a stage's schema, 7x a copy); callers get a deep copy, so the cached tree is never modified."""
    return OmegaConf.structured(schema)


def defaults(schema: type):
    """A fresh ``DictConfig`` of ``schema``'s defaults (a deep copy of the cached one)."""
    return copy.deepcopy(_schema_defaults(schema))


def load_config(schema: type[T], path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Merge ``path`` (YAML) then ``overrides`` (``dotted.key=value``) onto ``schema``'s defaults."""
    cfg = defaults(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml errors come in several types
            raise ConfigError(yaml_error(path, e)) from e
        if loaded is not None and not OmegaConf.is_dict(loaded):
            raise ConfigError(f"{path}: top level must be a mapping of keys")
        try:
            cfg = OmegaConf.merge(cfg, loaded or {})
        except OmegaConfBaseException as e:
            raise ConfigError(f"{path}: {_describe(e, schema)}") from e
    for item in overrides:
        if item.startswith("~"):  # ~key.path removes a key (e.g. the previous part's option)
            _delete(cfg, item[1:].strip(), item)
            continue
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' must look like key.path=value")
        key, _, raw = item.partition("=")
        try:  # update, not a merge of a dotlist: `stages.1.overrides=[...]` indexes the list
            parsed = OmegaConf.from_dotlist([f"value={raw}"])  # the value as a dotlist parses it,
            value = OmegaConf.to_container(parsed, resolve=False)["value"]  # ${...} kept for the full config
            _check_indices(cfg, key.strip(), item)
            _warn_if_merged(cfg, key.strip(), value, item, path)
            OmegaConf.update(cfg, key.strip(), value, merge=True)
        except (OmegaConfBaseException, TypeError, IndexError, yaml.YAMLError) as e:
            raise ConfigError(f"command line: {_describe(e, schema)} (in '{item}')") from e
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path or 'config'}: {_describe(e, schema)}") from e
    try:
        validate(obj)
    except ValueError as e:
        where = " + ".join(([str(path)] if path is not None else []) + (["command line"] if overrides else []))
        raise ConfigError(f"{where or 'config'}: {e}") from e
    return obj


def yaml_error(path: Path, e: Exception) -> str:
    """``FILE:LINE:COLUMN: not valid YAML: PROBLEM (while CONTEXT at line L, column C)`` (1-based, from
    the parser's marks); without a mark, the parser's first line."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return f"{path}: not valid YAML: {(str(e).splitlines() or [type(e).__name__])[0]}"
    context, where = getattr(e, "context", None), getattr(e, "context_mark", None)
    also = f" ({context} at line {where.line + 1}, column {where.column + 1})" if context and where else ""
    return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {e.problem}{also}"


def _check_indices(cfg, key: str, item: str) -> None:
    """``ConfigError`` for a list index in ``key`` past the list's end (``stages.5.overrides=...`` on a
    pipeline of 2 stages), naming how many entries the list has."""
    parts = key.split(".")
    for i, part in enumerate(parts[1:], 1):
        node = OmegaConf.select(cfg, ".".join(parts[:i]), default=None, throw_on_missing=False)
        if not (OmegaConf.is_list(node) and part.lstrip("-").isdigit()):
            continue
        if not -len(node) <= int(part) < len(node):
            where = ".".join(parts[:i])
            has = f"the pipeline has {len(node)} stage(s)" if where == "stages" else f"{where} has {len(node)} entries"
            raise ConfigError(f"command line: '{item}': no {where}.{part}: {has} (indices 0 to {len(node) - 1})")


def _free_mapping(node) -> bool:
    """Whether ``node`` is a free-form mapping (``dict[str, Any]`` field: ``rewards``, a part's options),
    not a structured block with fixed keys."""
    return OmegaConf.is_dict(node) and OmegaConf.get_type(node) is dict


def _warn_if_merged(cfg, key: str, value, item: str, path) -> None:
    """Warn when the override ``key=value`` merges into a non-empty free-form mapping that keeps
    entries the override does not name (``rewards={x: 1}`` keeps the file's rewards: a sum of both);
    for ``rewards``, also when ``rewards.x=...`` adds an entry beside others. ``~key`` first replaces."""
    parent_key, _, leaf = key.rpartition(".")
    target = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    if isinstance(value, dict) and _free_mapping(target) and (kept := sorted(set(target) - set(value))):
        block = key
    elif parent_key == "rewards" and _free_mapping(parent := OmegaConf.select(cfg, "rewards", default=None)) \
            and leaf not in parent and len(parent):
        block, kept = "rewards", sorted(parent)
    else:
        return
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        log.warning("command line: '%s' merges into %s, which keeps %s from %s; to replace the block, put '~%s' "
                    "before it", item, block, ", ".join(map(str, kept)), path or "the defaults", block)


def _delete(cfg, key: str, item: str) -> None:
    """Remove ``key`` (dotted) from ``cfg``: only keys of free-form mappings (a registered part's
    options, ``rewards``) can go; a free-form mapping that is a field of its block (``~rewards``) is
    emptied instead, so that the overrides after it fill it anew. ``ConfigError`` naming the override
    otherwise."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if parent is None or not OmegaConf.is_dict(parent) or leaf not in parent:
        raise ConfigError(f"command line: '{item}': no key '{key}' to remove")
    try:
        if _free_mapping(parent):
            del parent[leaf]
        elif _free_mapping(parent[leaf]):
            OmegaConf.update(cfg, key, {}, merge=False)
        else:
            del parent[leaf]
    except OmegaConfBaseException as e:
        raise ConfigError(f"command line: '{item}': {_describe(e)}") from e


def load_section(schema: type[T], values: dict, key: str) -> T:
    """A ``schema`` instance from the mapping ``values`` (one block of a config, e.g. a registered
    part's options), validated; ``ValueError`` naming ``key.<field>`` for an unknown field or a wrong
    type (the caller's config loading turns it into a ``ConfigError`` naming the file)."""
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(defaults(schema), dict(values)))
    except OmegaConfBaseException as e:
        field_name = getattr(e, "full_key", None) or getattr(e, "key", None)
        msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
        raise ValueError(f"{key}.{field_name}: {msg}" if field_name else f"{key}: {msg}") from e
    validate(obj, f"{key}.")
    return obj


def validate(obj, prefix: str = "") -> None:
    """Call ``validate(prefix)`` on every nested config dataclass (children first). A component's
    ``validate`` raises ``ValueError`` whose message starts with the dotted key it rejects."""
    if not is_dataclass(obj):
        return
    for f in fields(obj):
        validate(getattr(obj, f.name), f"{prefix}{f.name}.")
    check = getattr(obj, "validate", None)
    if callable(check):
        check(prefix)


def require_positive(cfg, prefix: str, *names: str) -> None:
    """``ValueError`` naming ``prefix + name`` for the first of ``names`` whose value is below 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{prefix}{name}: must be >= 1, got {getattr(cfg, name)}")


def save_config(cfg, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
