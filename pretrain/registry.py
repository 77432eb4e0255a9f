"""The one registry class: name -> entry, for every kind of thing chosen by name in a config.

Model families, rollout step types, ODE solvers, rewards, the GRPO algorithm's parts, stages and
rollout engines are each a :class:`Registry`. An entry is either the object itself or a lazy
``"module.path:attr"`` string imported on first use (so a registry can list Ray's engine without
importing Ray). Where a registry allows it, a config may also name an entry of the user's own by its
import path ``pkg.module:attr`` (``attr`` may be dotted), with no registration at all.

Errors name the config key and list the known names: ``ValueError("rollout.step: unknown rollout step
'sdee'; known: ['cps', 'ddim', 'ode', 'sde']")``.

A leaf utility of ``pretrain`` (it imports nothing of the project).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator


def is_import_path(name: object) -> bool:
    """Whether ``name`` is written as an import path ``pkg.module:attr``."""
    return isinstance(name, str) and ":" in name


def import_path(path: str, key: str) -> Any:
    """The object at ``pkg.module:attr`` (``attr`` may be dotted). ``ValueError`` naming ``key`` when the
    path is malformed, the module fails to import (any error raised while it runs) or lacks the attribute."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".") + attr.split(".")):
        raise ValueError(f"{key}: an import path must look like 'pkg.module:attr'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while the user's module runs
        raise ValueError(f"{key}: cannot import module '{module_name}': {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


class Registry(Mapping):
    """Name -> entry for one ``kind`` of thing (the word used in error messages).

    ``entries``: the built-in entries, each an object or a lazy ``"module:attr"`` string; ``key``: the config
    key named in errors by default (e.g. ``"rollout.step"``); ``load``: called once before the first
    lookup (e.g. to import the modules whose decorators register the built-ins); ``import_paths``: whether
    :meth:`get` accepts ``pkg.module:attr`` for a name that is not registered.

    A read-only :class:`~collections.abc.Mapping` over the resolved entries (``reg[name]``, ``name in reg``,
    ``sorted(reg)``); add with :meth:`register`, remove with :meth:`unregister`.
    """

    def __init__(self, kind: str, entries: dict[str, Any] | None = None, *, key: str = "name",
                 load: Callable[[], None] | None = None, import_paths: bool = False):
        self.kind, self.key, self.import_paths = kind, key, import_paths
        self._entries: dict[str, Any] = dict(entries or {})
        self._load, self._loaded = load, load is None

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._load()

    def register(self, name: str, entry: Any = None, *, replace: bool = False):
        """Add ``entry`` under ``name``; with ``entry`` omitted, a decorator that registers what it wraps.
        ``ValueError`` if another entry holds ``name`` (re-registering the same object is allowed) unless
        ``replace``."""
        def add(obj):
            current = self._entries.get(name, obj)
            if current is not obj and not replace:
                raise ValueError(f"{self.kind} '{name}' is already registered ({_describe(current)})")
            self._entries[name] = obj
            return obj
        return add if entry is None else add(entry)

    def unregister(self, name: str) -> Any:
        """Remove and return the entry ``name``; ``KeyError`` naming it if it is not registered."""
        if name not in self._entries:
            raise KeyError(f"{self.kind} '{name}' is not registered")
        return self._entries.pop(name)

    def get(self, name: str, key: str | None = None) -> Any:  # type: ignore[override]
        """The entry ``name`` (a lazy one imported now), or for an unregistered ``pkg.module:attr`` where
        import paths are allowed the imported object. ``ValueError`` naming ``key`` (default: the
        registry's) and listing the known names."""
        key = key or self.key
        self._ensure_loaded()
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry, str) and is_import_path(entry):
                entry = self._entries[name] = import_path(entry, f"{key} ({self.kind} '{name}')")
            return entry
        if self.import_paths and is_import_path(name):
            return import_path(name, key)
        hint = " or an import path 'pkg.module:attr'" if self.import_paths else ""
        raise ValueError(f"{key}: unknown {self.kind} '{name}'; known: {self.names()}{hint}")

    def names(self) -> list[str]:
        """The registered names, sorted (built-ins included)."""
        self._ensure_loaded()
        return sorted(self._entries)

    def __getitem__(self, name: str) -> Any:
        self._ensure_loaded()
        if name not in self._entries:
            raise KeyError(name)
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._ensure_loaded()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


def _describe(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)
