"""The one registry class: lazy entries import on first use, errors name the key and list the known names,
import paths resolve where allowed, and every registry of the project is one."""

import sys

import pytest

from pretrain.registry import Registry, import_path

pytestmark = pytest.mark.core


def test_lookup_errors_name_the_key_and_list_the_names():
    reg = Registry("widget", {"b": 2, "a": 1}, key="thing.kind")
    assert reg.get("a") == 1 and reg["b"] == 2 and sorted(reg) == ["a", "b"] and len(reg) == 2
    with pytest.raises(ValueError, match=r"^thing\.kind: unknown widget 'c'; known: \['a', 'b'\]$"):
        reg.get("c")
    with pytest.raises(ValueError, match=r"^other\.key: unknown widget 'c'"):
        reg.get("c", "other.key")
    with pytest.raises(KeyError):
        reg["c"]


def test_register_refuses_a_taken_name_unless_replaced_and_unregister_names_it():
    reg = Registry("widget")

    @reg.register("x")
    def first():
        return 1

    reg.register("x", first)  # the same object again: allowed
    with pytest.raises(ValueError, match=r"widget 'x' is already registered \(.*first\)"):
        reg.register("x", lambda: 2)
    reg.register("x", len, replace=True)
    assert reg.get("x") is len and reg.unregister("x") is len and "x" not in reg
    with pytest.raises(KeyError, match="widget 'x' is not registered"):
        reg.unregister("x")


def test_lazy_entries_import_on_first_use_and_load_runs_once(tmp_path, monkeypatch):
    (tmp_path / "lazy_mod_for_registry.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    reg = Registry("thing", {"lazy": "lazy_mod_for_registry:VALUE"}, load=lambda: calls.append(1))
    assert "lazy_mod_for_registry" not in sys.modules
    assert reg.names() == ["lazy"] and "lazy_mod_for_registry" not in sys.modules  # listing imports nothing
    value = reg.get("lazy")
    assert value is sys.modules["lazy_mod_for_registry"].VALUE and reg.get("lazy") is value
    assert calls == [1]


def test_import_paths_where_allowed():
    reg = Registry("reducer", key="op", import_paths=True)
    assert reg.get("math:sqrt")(9.0) == 3.0
    with pytest.raises(ValueError, match=r"^op: module 'math' has no attribute 'nope'"):
        reg.get("math:nope")
    with pytest.raises(ValueError, match=r"^op: cannot import module 'no_such_mod_xyz': ModuleNotFoundError"):
        reg.get("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match=r"^k: an import path must look like 'pkg.module:attr'"):
        import_path("math:", "k")
    closed = Registry("reducer", key="op")
    with pytest.raises(ValueError, match=r"^op: unknown reducer 'math:sqrt'; known: \[\]$"):
        closed.get("math:sqrt")


def test_every_registry_of_the_project_is_one():
    from posttrain.grpo.engines import ENGINES
    from posttrain.grpo.parts.registry import ADVANTAGES, LOSSES, SELECTIONS
    from posttrain.stages import STAGES
    from pretrain.models import FAMILIES
    from rewards.base import REGISTRY
    from rollout.ode_solver import ODE_SOLVERS
    from rollout.steps import STEPS

    for reg in (ENGINES, ADVANTAGES, LOSSES, SELECTIONS, STAGES, FAMILIES, REGISTRY, ODE_SOLVERS, STEPS):
        assert isinstance(reg, Registry) and len(reg) >= 2, reg
    assert {"sd3", "flux", "wan", "unet"} <= set(FAMILIES) and {"grpo", "dpo", "pretrain"} <= set(STAGES)
    with pytest.raises(ValueError, match=r"^model\.arch: unknown model family 'nope'; known: \["):
        FAMILIES.get("nope")
    with pytest.raises(ValueError, match=r"^engine\.name: unknown rollout engine 'gpu'; known: \['local', 'ray'\]"):
        ENGINES.get("gpu")
