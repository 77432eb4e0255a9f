"""A check of a config's keys that needs neither torch nor diffusers: the CLI answers a typo in a key in
well under a second, before the stage's modules (and their heavy imports) load.

The key trees of the stage schemas are kept in a JSON file (the CLI's: ``posttrain/config_keys.json``,
written by ``python scripts/write_config_keys.py``; a unit test fails when it differs from the schemas). A tree maps each
field to its sub-tree, ``"leaf"`` (a value) or ``"open"`` (a free-form mapping, a list, an ``Any`` or an
optional block: keys under it are left to the full load). Only keys that are certainly unknown are
refused, with the message the full load gives (``ConfigError``); everything else (types, values) is
checked by :func:`pretrain.config.load_config` as before.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from omegaconf import OmegaConf

from pretrain.config import ConfigError, yaml_error

LEAF, OPEN = "leaf", "open"


def key_tree(schema: type) -> dict:
    """``{"class": name, "fields": {field: sub-tree | "leaf" | "open"}, "moved": {old key: new key}}`` of a
    config dataclass (``moved``: its ``moved_keys``, named in the unknown-key error as the full load does)."""
    return {**_tree(OmegaConf.structured(schema)), "moved": dict(getattr(schema, "moved_keys", {}))}


def _tree(node) -> dict:
    fields = {}
    for name in node.keys():
        child = node._get_node(name)
        if OmegaConf.is_dict(child):
            structured = OmegaConf.get_type(child) not in (dict, None) and not child._is_none()
            fields[name] = _tree(child) if structured else OPEN
        elif OmegaConf.is_list(child) or type(child).__name__ == "AnyNode":
            fields[name] = OPEN
        else:
            fields[name] = LEAF
    return {"class": OmegaConf.get_type(node).__name__, "fields": fields}


def _unknown(tree: dict, parts: list[str]) -> str | None:
    """The message for the first component of ``parts`` that ``tree`` certainly does not have, or None."""
    moved = tree.get("moved", {})
    for i, part in enumerate(parts):
        if part not in tree["fields"]:
            key = ".".join(parts[:i + 1])
            hint = f" (it moved to '{moved[key]}')" if key in moved else ""
            return f"key '{key}': Key '{part}' not in '{tree['class']}'{_suggest(part, tree)}{hint}"
        sub = tree["fields"][part]
        if not isinstance(sub, dict):
            return None  # a leaf (a type error is the full load's) or an open node
        tree = sub
    return None


def _suggest(key: str, tree: dict) -> str:
    """OmegaConf's "Did you mean" for ``key`` among the fields of ``tree`` (the same rule, so the early
    check and the full load print the same line)."""
    close = difflib.get_close_matches(key, list(tree["fields"]), n=3, cutoff=0.6)
    if not close:
        return ""
    return f". Did you mean: {close[0]!r}?" if len(close) == 1 else \
        f". Did you mean one of: {', '.join(repr(k) for k in close)}?"


def _paths(mapping, prefix: list[str]):
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from _paths(value, [*prefix, str(key)])
        else:
            yield [*prefix, str(key)]


def check_keys(trees_file: str | Path, command: str, path: str | Path | None,
               overrides: list[str] | tuple[str, ...] = ()) -> None:
    """``ConfigError`` (the full load's message) for a missing or unparsable file, or a key of the file
    or of an override that ``command``'s tree in ``trees_file`` certainly lacks; nothing for a command
    without a recorded tree."""
    trees = json.loads(Path(trees_file).read_text())
    if command not in trees:
        return
    tree = trees[command]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as e:  # yaml errors come in several types
            raise ConfigError(yaml_error(path, e)) from e
        if isinstance(loaded, dict):
            for parts in _paths(loaded, []):
                if (bad := _unknown(tree, parts)) is not None:
                    raise ConfigError(f"{path}: {bad}")
    for item in overrides:
        key = item[1:] if item.startswith("~") else item.partition("=")[0]
        if (bad := _unknown(tree, key.strip().split("."))) is not None:
            raise ConfigError(f"command line: {bad} (in '{item}')")


def write_snapshot(schemas: dict[str, type], out: str | Path) -> dict:
    """Write the key trees of ``schemas`` (``{command: config dataclass}``) as JSON to ``out``."""
    trees = {command: key_tree(schema) for command, schema in sorted(schemas.items())}
    Path(out).write_text(json.dumps(trees, indent=1, sort_keys=True) + "\n")
    return trees
