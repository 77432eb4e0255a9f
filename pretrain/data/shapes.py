"""Procedural compositional scenes with structured captions: GenEval's six categories on coloured shapes.

A scene is a few flat shapes (circle, square, triangle) in a palette of well-separated colours on a white
background. Every caption is generated from a :class:`SceneSpec` (the prompt's structured requirements), so
the caption and its check cannot disagree: :func:`spec_for_caption` looks a caption up in the table of every
spec the grammar can produce (no free-text parsing), and the exact judge (:mod:`rewards.shapes`) checks the
spec. Categories follow GenEval (Ghosh et al. 2023, arXiv 2310.11513, sec. 3): ``single_object`` ("a
circle"), ``two_object`` ("a circle and a square"), ``counting`` ("three green triangles", exact count),
``colors`` ("a red circle"), ``position`` ("a red circle to the left of a blue square") and ``color_attr``
("a red square and a green circle").

The held-out prompts include compositions never rendered for pretraining: a hash of the caption holds out a
share of the counting, position and colour-attribution specs (:func:`is_novel`); their parts (each
colour-shape pair, each count, each relation) are all seen in other combinations. The three small
categories (3, 12 and 6 specs) are held out by seed only. Rendering is deterministic from a seed (NumPy's
PCG64) and imports nothing else of the project, so rewards may use it.

The same grammar gives the editing task (the section "instruction edits" below): one object of a colour scene
recoloured or reshaped by an instruction, the target drawn at the source's places.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

#: The palette (sRGB, 0-255): pairwise distances >= 150, each >= 100 from white.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215), "yellow": (230, 190, 20)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")
RELATION_TEXT = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
VERSION = 3  # in the cache key: bump when rendering or the grammar changes
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
BACKGROUND = (255, 255, 255)
NOVEL_CATEGORIES = ("counting", "position", "color_attr")


@dataclass(frozen=True)
class ObjectReq:
    """One object requirement: ``count`` objects of ``shape`` (of ``colour``, or any colour when None);
    ``exact``: exactly ``count`` (GenEval's counting), else at least."""

    shape: str
    colour: str | None = None
    count: int = 1
    exact: bool = False

    def phrase(self) -> str:
        if self.count == 1:
            return " ".join(w for w in ("a", self.colour, self.shape) if w)
        return " ".join(w for w in (NUMBERS[self.count], self.colour, self.shape + "s") if w)


@dataclass(frozen=True)
class SceneSpec:
    """A prompt's structured requirements: its GenEval ``category``, the ``objects`` it asks for and, for
    ``position``, the ``relation`` of ``objects[0]`` to ``objects[1]`` (one of :data:`RELATIONS`)."""

    category: str
    objects: tuple[ObjectReq, ...]
    relation: str | None = None

    @property
    def caption(self) -> str:
        if self.relation:
            return f"{self.objects[0].phrase()} {RELATION_TEXT[self.relation]} {self.objects[1].phrase()}"
        return " and ".join(o.phrase() for o in self.objects)


@lru_cache(maxsize=1)
def all_specs() -> tuple[SceneSpec, ...]:
    """Every spec of the grammar, in a fixed order (category, then colours and shapes as listed): 3
    single-object, 6 two-object, 36 counting, 12 colour, 528 position and 72 colour-attribution specs."""
    pairs = [(c, s) for s in SHAPES for c in COLOURS]
    out = [SceneSpec("single_object", (ObjectReq(s),)) for s in SHAPES]
    out += [SceneSpec("two_object", (ObjectReq(a), ObjectReq(b))) for a in SHAPES for b in SHAPES if a != b]
    out += [SceneSpec("counting", (ObjectReq(s, c, n, exact=True),)) for n in NUMBERS for c, s in pairs]
    out += [SceneSpec("colors", (ObjectReq(s, c),)) for c, s in pairs]
    out += [SceneSpec("position", (ObjectReq(s1, c1), ObjectReq(s2, c2)), rel)
            for c1, s1 in pairs for c2, s2 in pairs if (c1, s1) != (c2, s2) for rel in RELATIONS]
    out += [SceneSpec("color_attr", (ObjectReq(s1, c1), ObjectReq(s2, c2)))
            for c1, s1 in pairs for c2, s2 in pairs if c1 != c2 and s1 != s2]
    return tuple(out)


@lru_cache(maxsize=1)
def _caption_table() -> dict[str, SceneSpec]:
    table = {s.caption: s for s in all_specs()}
    assert len(table) == len(all_specs()), "two specs share a caption"
    return table


def spec_for_caption(caption: str) -> SceneSpec:
    """The spec whose caption is ``caption`` (a table lookup, not a parse). ``KeyError`` naming the
    caption when the grammar cannot produce it."""
    try:
        return _caption_table()[caption]
    except KeyError:
        raise KeyError(f"shapes: '{caption}' is not a caption of the shapes grammar (e.g. "
                       f"'{all_specs()[-1].caption}')") from None


#: The kinds of :func:`minimal_edits`, in its order.
EDIT_KINDS = ("colour", "shape", "count", "relation", "order", "binding")


def minimal_edits(spec: SceneSpec) -> dict[str, list[SceneSpec]]:
    """The specs of the grammar one change away from ``spec``, by kind (:data:`EDIT_KINDS`; a kind with
    none is an empty list): ``colour`` / ``shape``: one object's replaced; ``count``: an exact count moved
    by one; ``relation``: replaced; ``order``: the two objects swapped, same relation; ``binding``: the
    colours of two coloured objects swapped. Each is the grammar's own spec for its caption (an exact count
    of one is the ``colors`` spec "a green square"), listed once (under its first kind) and never
    ``spec``. Contrast captions for a learned judge: each differs from ``spec`` in one requirement, so the
    exact judge's partial score of an image against it differs only there; swapping the objects of a
    two-object or colour-attribution prompt changes nothing, and the judge scores it so."""
    table, seen = _caption_table(), {spec}
    out: dict[str, list[SceneSpec]] = {k: [] for k in EDIT_KINDS}

    def add(kind: str, objects: tuple[ObjectReq, ...], relation: str | None) -> None:
        cand = table.get(SceneSpec(spec.category, objects, relation).caption)
        if cand is not None and cand not in seen:
            seen.add(cand)
            out[kind].append(cand)

    objs, rel = spec.objects, spec.relation
    for i, o in enumerate(objs):
        swap = lambda **kw: objs[:i] + (replace(o, **kw),) + objs[i + 1:]  # noqa: E731
        for c in COLOURS if o.colour is not None else ():
            add("colour", swap(colour=c), rel)
        for s in SHAPES:
            add("shape", swap(shape=s), rel)
        for n in (o.count - 1, o.count + 1) if o.exact else ():
            if n in NUMBERS or n == 1:
                add("count", swap(count=n), rel)
    for r in RELATIONS if rel else ():
        add("relation", objs, r)
    if len(objs) == 2:
        add("order", objs[::-1], rel)
        a, b = objs
        if a.colour is not None and b.colour is not None:
            add("binding", (replace(a, colour=b.colour), replace(b, colour=a.colour)), rel)
    return out


def is_novel(spec: SceneSpec, fraction: float) -> bool:
    """True for about ``fraction`` of the counting, position and colour-attribution specs (by a hash of
    the caption): compositions held out of pretraining. Always False for the other categories."""
    if spec.category not in NOVEL_CATEGORIES:
        return False
    h = int.from_bytes(hashlib.sha256(f"shapes:{spec.caption}".encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def split_specs(fraction: float) -> tuple[list[SceneSpec], list[SceneSpec]]:
    """(specs rendered for pretraining, novel specs): every spec is in exactly one list."""
    specs = all_specs()
    return [s for s in specs if not is_novel(s, fraction)], [s for s in specs if is_novel(s, fraction)]


# ---- rendering ------------------------------------------------------------------------------------------

def shape_mask(shape: str, side: int) -> np.ndarray:
    """bool ``[side, side]``: the shape filling a ``side`` px box: a disc, the whole square, or a triangle
    pointing up with its base on the bottom row. ``ValueError`` for an unknown shape."""
    yy, xx = np.mgrid[0:side, 0:side] + 0.5
    if shape == "circle":
        r = side / 2
        return (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "triangle":
        half = xx - side / 2
        return np.abs(half) <= yy / 2
    raise ValueError(f"unknown shape '{shape}' (known: {SHAPES})")


@dataclass(frozen=True)
class Placed:
    """A rendered object: ``shape``, ``colour``, top-left ``(y, x)`` and ``side`` in output pixels."""

    shape: str
    colour: str
    y: int
    x: int
    side: int

    @property
    def centre(self) -> tuple[float, float]:
        return self.y + self.side / 2, self.x + self.side / 2


def _objects_to_place(spec: SceneSpec, rng: np.random.Generator) -> list[tuple[str, str]]:
    colours = list(COLOURS)
    out = []
    for o in spec.objects:
        out += [(o.shape, o.colour or colours[rng.integers(len(colours))])] * o.count
    return out


LAYOUTS = ("random", "reading")


def _cells(spec: SceneSpec, n: int, rng: np.random.Generator, order: str = "random") -> list[tuple[int, int]]:
    """``n`` distinct (row, col) cells of the 2 x 2 grid; for a position spec the first two are a pair in
    one row (left / right of) or one column (above / below) in the relation's order. ``order``: "random"
    (random cells; a random row or column for a pair) or "reading" (cells in reading order; a pair in
    the top row or the left column)."""
    if spec.relation:
        k = int(rng.integers(2)) if order == "random" else 0
        first, second = ((k, 0), (k, 1)) if spec.relation in ("left of", "right of") else ((0, k), (1, k))
        return [first, second] if spec.relation in ("left of", "above") else [second, first]
    cells = rng.permutation(4)[:n] if order == "random" else range(n)
    return [(int(c) // 2, int(c) % 2) for c in cells]


def layout(spec: SceneSpec, size: int, rng: np.random.Generator, order: str = "random") -> list[Placed]:
    """Placements for ``spec`` on a ``size`` px canvas split in a 2 x 2 grid of cells: one object per
    cell, its side between 0.31 and 0.375 of ``size`` (10-12 px at 32 px), centred in its cell with a
    jitter of up to ``size // 32`` px, so objects stay at least 2 px apart at 32 px. A position spec's
    pair shares a row (left / right of) or a column (above / below); the cells follow ``order`` (see
    :func:`_cells`; ``ValueError`` for another)."""
    if order not in LAYOUTS:
        raise ValueError(f"unknown shapes layout '{order}' (known: {LAYOUTS})")
    objs = _objects_to_place(spec, rng)
    cell, jitter = size // 2, max(1, size // 32)
    placed = []
    for (shape, colour), (r, c) in zip(objs, _cells(spec, len(objs), rng, order)):
        s = int(rng.integers(round(0.31 * size), round(0.375 * size) + 1))
        dy, dx = (int(v) for v in rng.integers(-jitter, jitter + 1, size=2))
        placed.append(Placed(shape, colour, r * cell + (cell - s) // 2 + dy, c * cell + (cell - s) // 2 + dx, s))
    return placed


def render(objects: list[Placed], size: int, oversample: int = 4) -> np.ndarray:
    """uint8 ``[3, size, size]``: ``objects`` drawn on white at ``oversample`` x and box-filtered down
    (anti-aliased edges)."""
    big = np.empty((size * oversample, size * oversample, 3), np.float32)
    big[:] = BACKGROUND
    for o in objects:
        s = o.side * oversample
        m = shape_mask(o.shape, s)
        y, x = o.y * oversample, o.x * oversample
        big[y:y + s, x:x + s][m] = COLOURS[o.colour]
    small = big.reshape(size, oversample, size, oversample, 3).mean((1, 3))
    return np.round(small).astype(np.uint8).transpose(2, 0, 1)


def render_spec(spec: SceneSpec, size: int, seed: int, order: str = "random") -> tuple[np.ndarray, list[Placed]]:
    """A deterministic render of ``spec`` from ``seed`` with cells in ``order`` (:func:`layout`): (uint8
    ``[3, size, size]``, its placements)."""
    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha256(spec.caption.encode()).digest()[:4], "big")])
    objs = layout(spec, size, rng, order)
    return render(objs, size), objs


def draw_specs(specs: list[SceneSpec], n: int, seed: int) -> list[SceneSpec]:
    """``n`` specs drawn from ``specs``: a category uniformly among those present, then a spec of it
    uniformly (so the 528 position specs do not crowd out the 3 single-object ones)."""
    rng = np.random.default_rng([seed, 7])
    by_cat: dict[str, list[SceneSpec]] = {}
    for s in specs:
        by_cat.setdefault(s.category, []).append(s)
    cats = [c for c in CATEGORIES if c in by_cat]
    picks = rng.integers(len(cats), size=n)
    return [by_cat[cats[c]][int(rng.integers(len(by_cat[cats[c]])))] for c in picks]


def heldout_specs(novel: list[SceneSpec], seen: list[SceneSpec], per_category: int) -> list[SceneSpec]:
    """The held-out prompt list: ``per_category`` rows per category, interleaved by category (so evenly
    spaced picks cover every category). A category with novel specs uses only those; the others use
    their (seen) specs, in an order shuffled with a fixed seed (so a cut does not keep only the first
    colours); specs repeat in that order when a category has fewer than ``per_category``."""
    cols = []
    for k, cat in enumerate(CATEGORIES):
        pool = [s for s in novel if s.category == cat] or [s for s in seen if s.category == cat]
        pool = [pool[i] for i in np.random.default_rng([k, 11]).permutation(len(pool))]
        cols.append([pool[i % len(pool)] for i in range(per_category)])
    return [cols[c][i] for i in range(per_category) for c in range(len(CATEGORIES))]


# ---- instruction edits: the editing task ------------------------------------------------------------
# Instruction edits of shapes scenes: the data of a tiny editing task whose result an exact judge checks.
#
# An edit takes a source scene (a ``colors``, ``position`` or ``color_attr`` spec of
# :mod:`pretrain.data.shapes`: every object one of a named colour), changes one requirement of one object
# (its colour: "make the red circle blue"; or its shape: "turn the red circle into a square") and asks for
# the target scene: the grammar's own spec one such change away (:func:`pretrain.data.shapes.minimal_edits`),
# drawn at the source's places, so everything the instruction does not name stays where it was. The prompt
# a model reads is ``"<source caption>; <instruction>"`` with the source image as its conditioning image;
# :func:`edit_for_prompt` looks the prompt up in the table of every edit (no free-text parsing), and the
# exact judge checks the output against the target spec's caption (:mod:`rewards.shapes`), which keeps every
# object the instruction leaves alone among the requirements. Deterministic from a seed; imports nothing of
# the project beyond the shapes grammar, so rewards may use it.

#: The kinds of edit, in the table's order.
EDIT_OPS = ("colour", "shape")
#: The source categories: every object has a colour and a count of one.
SOURCE_CATEGORIES = ("colors", "position", "color_attr")


@dataclass(frozen=True)
class EditSpec:
    """One edit: the ``source`` scene, the ``target`` scene (one object's colour or shape changed,
    ``op``), and the ``index`` of that object in both specs' ``objects``."""

    source: SceneSpec
    target: SceneSpec
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


def _changed(source: SceneSpec, target: SceneSpec) -> tuple[str, int] | None:
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
    for source in all_specs():
        if source.category not in SOURCE_CATEGORIES:
            continue
        edits = minimal_edits(source)
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


def is_novel_edit(edit: EditSpec, fraction: float) -> bool:
    """True for about ``fraction`` of the edits (by a hash of the prompt): edits held out of training."""
    h = int.from_bytes(hashlib.sha256(f"shapes_edit:{edit.prompt}".encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def render_edit(edit: EditSpec, size: int, seed: int, order: str = "reading"
                ) -> tuple[np.ndarray, np.ndarray, list[Placed]]:
    """(source uint8 ``[3, size, size]``, target uint8 ``[3, size, size]``, the source's placements): the
    source drawn as :func:`pretrain.data.render_spec` draws it from ``seed``, the target with the
    same placements but the edited object's colour or shape."""
    source, placed = render_spec(edit.source, size, seed, order)
    after = edit.target.objects[edit.index]
    moved = list(placed)
    moved[edit.index] = replace(placed[edit.index], colour=after.colour, shape=after.shape)
    return source, render(moved, size), placed
