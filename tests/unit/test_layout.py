"""The product folders' import graph: imports run one way and close no circle.

Every ``import`` / ``from ... import`` of the project's packages is read from the source (module level and
inside functions alike: a lazy import is still a dependency). The rules, from the bottom up:

- ``pretrain`` <- ``rollout`` <- ``posttrain``; ``rewards`` may import ``pretrain``'s leaf utilities (modules
  that import nothing of the project) and nothing else of ours; ``pretrain`` imports no reward.
- Inside ``posttrain``: ``objectives`` (the math) <- ``eval`` <- ``base`` <- the stages (``grpo``, ``dpo``,
  ``midtrain``, ``curate``, ``reward_gradient``, which import no other stage) <- ``stages`` (the table) <- ``tools`` and
  ``pipeline`` <- ``cli``.

Run alone: ``python -m pytest tests/unit/test_layout.py -q``; ``python tests/unit/test_layout.py`` prints the
graph's layer violations and circles (none expected).
"""

from __future__ import annotations

import pytest

import ast
import sys
from pathlib import Path

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pretrain", "rollout", "rewards", "posttrain")
#: posttrain's layers, lowest first: a module may import its own layer or one below.
POSTTRAIN_LAYERS = {"objectives": 0, "eval": 1, "base": 2, "grpo": 3, "dpo": 3, "midtrain": 3, "curate": 3,
                    "reward_gradient": 3, "stages": 4, "tools": 5, "pipeline": 5, "cli": 6, "__main__": 7}
STAGE_FOLDERS = {"grpo", "dpo", "midtrain", "curate", "reward_gradient"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path) -> set[str]:
    """The project modules ``path`` imports (``from pkg import name`` counts ``pkg.name`` when that is a
    module, else ``pkg``). Imports under ``if TYPE_CHECKING:`` (annotations only, never run) are left out."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            names += [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return out


def _is_module(name: str) -> bool:
    base = ROOT / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            graph[module_name(path)] = {m for m in project_imports(path)}
    return graph


def posttrain_layer(module: str) -> tuple[int, str]:
    part = module.split(".")[1] if "." in module else "__init__"
    return POSTTRAIN_LAYERS.get(part, -1), part


def violations(graph: dict[str, set[str]]) -> list[str]:
    leaves = {m for m, deps in graph.items() if m.startswith("pretrain") and not deps}
    out = []
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for dep in deps:
            dtop = dep.split(".")[0]
            if dep == mod or dep.startswith(mod + "."):
                continue  # a package importing its own submodules
            if top == "pretrain" and dtop != "pretrain":
                out.append(f"{mod} -> {dep}: pretrain imports nothing above it (no rollout, posttrain or reward)")
            elif top == "rollout" and dtop not in ("pretrain", "rollout"):
                out.append(f"{mod} -> {dep}: rollout imports only pretrain")
            elif top == "rewards" and dtop not in ("rewards",) and dep not in leaves:
                out.append(f"{mod} -> {dep}: rewards import only pretrain's leaf utilities")
            elif top == "posttrain" and dtop == "posttrain" and mod != "posttrain":
                (lm, pm), (ld, pd) = posttrain_layer(mod), posttrain_layer(dep)
                if ld > lm:
                    out.append(f"{mod} -> {dep}: upward import ({pm} is below {pd})")
                elif pm in STAGE_FOLDERS and pd in STAGE_FOLDERS and pm != pd:
                    out.append(f"{mod} -> {dep}: a stage imports another stage ({pm} -> {pd})")
    return sorted(out)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), ignoring a package's edges to
    its own submodules."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    edges = {m: {d for d in deps if d in graph and not d.startswith(m + ".") and d != m} for m, deps in graph.items()}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_imports_run_one_way():
    graph = import_graph()
    assert len(graph) > 150 and any(graph.values())  # the walk found the project
    assert violations(graph) == []


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_the_walk_sees_an_upward_import_and_a_circle():
    """The checks can fail: a planted upward import and a planted circle are both reported."""
    graph = {"pretrain.a": {"rewards.base"}, "rewards.base": {"pretrain.b"}, "pretrain.b": {"pretrain.a"},
             "posttrain.base.guard": {"posttrain.grpo.stage"}, "posttrain.grpo.stage": {"posttrain.dpo.stage"},
             "posttrain.dpo.stage": set()}
    found = violations(graph)
    assert any(v.startswith("pretrain.a -> rewards.base") for v in found)
    assert any(v.startswith("rewards.base -> pretrain.b") for v in found)  # pretrain.b is not a leaf
    assert any("upward import (base is below grpo)" in v for v in found)
    assert any("a stage imports another stage (grpo -> dpo)" in v for v in found)
    assert circles(graph) == [["pretrain.a", "pretrain.b", "rewards.base"]]


def test_posttrain_root_and_positional_parameters():
    """The posttrain root holds at most five modules (the CLI, the stage table, the pipeline); no public
    function in rollout/ or posttrain/ takes more than 6 positional parameters."""
    root = [p.name for p in (ROOT / "posttrain").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(root) <= 5, root
    long = []
    for pkg in ("rollout", "posttrain"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                    pos = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                    if len(pos) > 6:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({len(pos)})")
    assert long == []


if __name__ == "__main__":
    g = import_graph()
    print("\n".join(violations(g)) or "no upward import")
    print("\n".join(" <-> ".join(c) for c in circles(g)) or "no circle")
