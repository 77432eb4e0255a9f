"""Instruction edits of shapes scenes: the data of a tiny editing task whose result an exact judge checks.

An edit takes a source scene (a ``colors``, ``position`` or ``color_attr`` spec of
:mod:`pretrain.data.shapes`: every object one of a named colour), changes one requirement of one object
(its colour: "make the red circle blue"; or its shape: "turn the red circle into a square") and asks for
the target scene: the grammar's own spec one such change away (:func:`pretrain.data.shapes.minimal_edits`),
drawn at the source's places, so everything the instruction does not name stays where it was. The prompt
a model reads is ``"<source caption>; <instruction>"`` with the source image as its conditioning image;
:func:`edit_for_prompt` looks the prompt up in the table of every edit (no free-text parsing), and the
exact judge checks the output against the target spec's caption (:mod:`rewards.shapes`), which keeps every
object the instruction leaves alone among the requirements. Deterministic from a seed; imports nothing of
the project beyond the shapes grammar, so rewards may use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from pretrain.data import shapes

#: The kinds of edit, in the table's order.
EDIT_OPS = ("colour", "shape")
#: The source categories: every object has a colour and a count of one.
SOURCE_CATEGORIES = ("colors", "position", "color_attr")


@dataclass(frozen=True)
class EditSpec:
    """One edit: the ``source`` scene, the ``target`` scene (one object's colour or shape changed,
    ``op``), and the ``index`` of that object in both specs' ``objects``."""

    source: shapes.SceneSpec
    target: shapes.SceneSpec
    op: str
    index: int

    @property
    def instruction(self) -> str:
        """The instruction: "make the red circle blue" or "turn the red circle into a square"."""
        before, after = self.source.objects[self.index], self.target.objects[self.index]
        named = f"the {before.colour} {before.shape}"
        return f"make {named} {after.colour}" if self.op == "colour" else f"turn {named} into a {after.shape}"

    @property
    def prompt(self) -> str:
        """What the model reads beside the source image: ``"<source caption>; <instruction>"``."""
        return f"{self.source.caption}; {self.instruction}"


def _changed(source: shapes.SceneSpec, target: shapes.SceneSpec) -> tuple[str, int] | None:
    """(op, index) of the one object whose colour or shape differs, with the relation kept; None otherwise."""
    if source.relation != target.relation or len(source.objects) != len(target.objects):
        return None
    diffs = [(i, a, b) for i, (a, b) in enumerate(zip(source.objects, target.objects)) if a != b]
    if len(diffs) != 1:
        return None
    i, a, b = diffs[0]
    if a.colour != b.colour and a.shape == b.shape:
        return "colour", i
    if a.shape != b.shape and a.colour == b.colour:
        return "shape", i
    return None


@lru_cache(maxsize=1)
def all_edits() -> tuple[EditSpec, ...]:
    """Every edit of the grammar, in a fixed order (source specs as :func:`pretrain.data.shapes.all_specs`
    lists them, then colour edits before shape edits, targets as ``minimal_edits`` lists them)."""
    out = []
    for source in shapes.all_specs():
        if source.category not in SOURCE_CATEGORIES:
            continue
        edits = shapes.minimal_edits(source)
        for op in EDIT_OPS:
            for target in edits[op]:
                found = _changed(source, target)
                if found is not None and found[0] == op:
                    out.append(EditSpec(source, target, op, found[1]))
    return tuple(out)


@lru_cache(maxsize=1)
def _prompt_table() -> dict[str, EditSpec]:
    table = {e.prompt: e for e in all_edits()}
    assert len(table) == len(all_edits()), "two edits share a prompt"
    return table


def edit_for_prompt(prompt: str) -> EditSpec:
    """The edit whose prompt is ``prompt`` (a table lookup). ``KeyError`` naming the prompt when the
    grammar cannot produce it."""
    try:
        return _prompt_table()[prompt]
    except KeyError:
        raise KeyError(f"shapes_edit: '{prompt}' is not an edit prompt of the shapes grammar (e.g. "
                       f"'{all_edits()[0].prompt}')") from None


def is_novel(edit: EditSpec, fraction: float) -> bool:
    """True for about ``fraction`` of the edits (by a hash of the prompt): edits held out of training."""
    h = int.from_bytes(hashlib.sha256(f"shapes_edit:{edit.prompt}".encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def render_edit(edit: EditSpec, size: int, seed: int, order: str = "reading"
                ) -> tuple[np.ndarray, np.ndarray, list[shapes.Placed]]:
    """(source uint8 ``[3, size, size]``, target uint8 ``[3, size, size]``, the source's placements): the
    source drawn as :func:`pretrain.data.shapes.render_spec` draws it from ``seed``, the target with the
    same placements but the edited object's colour or shape."""
    source, placed = shapes.render_spec(edit.source, size, seed, order)
    after = edit.target.objects[edit.index]
    moved = list(placed)
    moved[edit.index] = replace(placed[edit.index], colour=after.colour, shape=after.shape)
    return source, shapes.render(moved, size), placed
