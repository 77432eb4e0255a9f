"""YAML -> typed dataclass configs (OmegaConf structured configs) with errors that name the key.

``load_config(Schema, path, ["a.b=1", ...])`` returns a ``Schema`` instance. An unknown key, a value of
the wrong type, a missing mandatory value or a missing/unparsable file raises ``ConfigError`` whose
message names the dotted key and the file (or "command line" for overrides); the CLI exits with 2.
An override ``~key.path`` removes a key of a free-form mapping (e.g. a registered part's option).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


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


def load_config(schema: type[T], path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Merge ``path`` (YAML) then ``overrides`` (``dotted.key=value``) onto ``schema``'s defaults."""
    cfg = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml errors come in several types
            raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from e
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


def _delete(cfg, key: str, item: str) -> None:
    """Remove ``key`` (dotted) from ``cfg``: only keys of free-form mappings (a registered part's
    options, ``rewards``) can go; ``ConfigError`` naming the override otherwise."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if parent is None or not OmegaConf.is_dict(parent) or leaf not in parent:
        raise ConfigError(f"command line: '{item}': no key '{key}' to remove")
    try:
        del parent[leaf]
    except OmegaConfBaseException as e:
        raise ConfigError(f"command line: '{item}': {_describe(e)}") from e


def load_section(schema: type[T], values: dict, key: str) -> T:
    """A ``schema`` instance from the mapping ``values`` (one block of a config, e.g. a registered
    part's options), validated; ``ValueError`` naming ``key.<field>`` for an unknown field or a wrong
    type (the caller's config loading turns it into a ``ConfigError`` naming the file)."""
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(values)))
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
