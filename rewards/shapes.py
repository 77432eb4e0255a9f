"""The exact judge of the shapes task (:mod:`pretrain.data.shapes`): GenEval's metric on coloured shapes.

Detection is geometry, not a learned model: each pixel is read as a mix of white and one palette colour
(:meth:`ShapesJudge.pixel_labels`); connected components of each colour (4-connected,
``scipy.ndimage.label``) of at least ``min_area`` pixels are objects; an object's shape comes from its
mask's geometry (a triangle has little of its area in its box's top half, a square fills its box's
corners, a disc leaves them empty); its position is its centroid. The prompt's requirements come from its
:class:`~pretrain.data.shapes.SceneSpec` (a table lookup of the caption), so a caption and its check cannot
disagree.

Per image the judge gives GenEval's strict correctness (every requirement met: GenEval, Ghosh et al. 2023,
arXiv 2310.11513, sec. 3.2) and a partial score for training, the mean over the prompt's requirement
items (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470, also trains on a partial GenEval score): per object, the shape present (fraction of the asked count found in any colour), the colour
bound (fraction found in the asked colour) and, for counting, the exact count (``1 - |found - asked| /
asked``, floored at 0); for position, the relation holding for some matching pair. A degenerate image (less
than ``min_background`` of it background, or more than ``max_unknown`` of it no palette colour: noise, one colour, NaN) scores 0, never NaN; a caption outside the grammar's table raises ``KeyError``
naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pretrain.data import shapes as grammar
from rewards.base import register


@dataclass(frozen=True)
class Detected:
    """A detected object: ``shape`` (or None when no template fits), ``colour``, centroid ``(cy, cx)`` in
    pixels, ``area`` in pixels, ``fill`` (the hole-filled area over the bounding-box area) and
    ``top_share`` (share of the hole-filled area in the box's top half)."""

    shape: str | None
    colour: str
    cy: float
    cx: float
    area: int
    fill: float
    top_share: float


@dataclass(frozen=True)
class Verdict:
    """The judge's reading of one image: ``strict`` (0 or 1), ``partial`` in [0, 1], the prompt's
    ``category``, the ``objects`` found (None for a degenerate image) and each requirement item's score."""

    strict: float
    partial: float
    category: str
    objects: list[Detected] | None
    items: dict[str, float]


_NAMES = list(grammar.COLOURS)
_BG = len(_NAMES)
_INK = np.float32(grammar.BACKGROUND) - np.array(list(grammar.COLOURS.values()), np.float32)  # [K, 3]


class ShapesJudge:
    """Reads images of the shapes task. Thresholds are in RGB units (0-255) and pixels of a ``size`` px
    image scaled from 32 px: ``max_distance`` of a pixel from its white-colour mix (see
    :meth:`pixel_labels`), ``min_area`` of an object (at 32 px; rendered objects have 50-144 px), its
    bounding box at most ``max_side`` of the image side (rendered: at most 0.375), the shape rules'
    ``max_top_share``, ``min_corner_fill``, ``min_disc_fill`` and ``max_aspect`` (:meth:`_shape`), and the
    ``min_background`` / ``max_unknown`` fractions of the image below which it is degenerate."""

    def __init__(self, max_distance: float = 60.0, min_area: int = 24, max_side: float = 0.5, max_top_share: float = 0.4,
                 min_corner_fill: float = 0.35, min_disc_fill: float = 0.5, max_aspect: float = 1.6,
                 min_background: float = 0.3, max_unknown: float = 0.3):
        self.max_distance, self.min_area, self.max_aspect = max_distance, min_area, max_aspect
        self.max_side = max_side
        self.max_top_share, self.min_corner_fill, self.min_disc_fill = max_top_share, min_corner_fill, min_disc_fill
        self.min_background, self.max_unknown = min_background, max_unknown

    def detect(self, image: np.ndarray) -> list[Detected] | None:
        """Objects in one image, uint8 or float 0-255 ``[3, H, W]``; None when it is degenerate."""
        from scipy import ndimage

        x = np.asarray(image, np.float32).transpose(1, 2, 0)
        h, w, _ = x.shape
        label = self.pixel_labels(x)
        if (label == _BG).mean() < self.min_background or (label < 0).mean() > self.max_unknown:
            return None
        min_area = max(3, round(self.min_area * h * w / 1024))
        found = []
        for k, colour in enumerate(_NAMES):
            comps, n = ndimage.label(label == k)
            for i, sl in enumerate(ndimage.find_objects(comps), start=1):
                mask = comps[sl] == i
                area = int(mask.sum())
                if area < min_area:
                    continue
                ys, xs = np.nonzero(mask)
                shape, fill, top = self._shape(mask)
                if max(mask.shape) > self.max_side * max(h, w):
                    shape = None  # a blob larger than any rendered object
                found.append(Detected(shape, colour, float(ys.mean() + sl[0].start + 0.5),
                                      float(xs.mean() + sl[1].start + 0.5), area, fill, top))
        return found

    def pixel_labels(self, x: np.ndarray) -> np.ndarray:
        """int ``[H, W]``: each pixel of ``x`` (float 0-255 ``[H, W, 3]``) as a mix of white and one palette
        colour ``k`` (``ink = alpha * (white - colour_k)``, least squares): ``k`` where the best-fitting
        colour's ``alpha >= 0.5`` and the fit's residual is at most ``max_distance``; the background index
        (``len(COLOURS)``) where every colour's ``alpha < 0.5``; -1 (no palette colour) otherwise. The
        0.5 level keeps a blurred shape's outline where the sharp one's was."""
        ink = np.float32(grammar.BACKGROUND) - x  # [H, W, 3]
        alpha = ink @ _INK.T / (_INK ** 2).sum(1)  # [H, W, K]
        resid = np.linalg.norm(ink[:, :, None, :] - alpha[..., None] * _INK, axis=-1)
        resid = np.where(alpha >= 0.5, resid, np.inf)
        best = resid.argmin(-1)
        label = np.where(resid.min(-1) <= self.max_distance, best, -1)
        return np.where((alpha < 0.5).all(-1), _BG, label)

    def _shape(self, mask: np.ndarray) -> tuple[str | None, float, float]:
        """(shape or None, fill, top share) of a component's bool mask cropped to its bounding box, its
        holes filled (speckle inside an object is not its outline): a triangle has under
        ``max_top_share`` of its area in the box's top half (a quarter when sharp); otherwise a square
        fills at least ``min_corner_fill`` of the box's corners (the box outside its inscribed ellipse:
        all of them for a square, none for a disc, so a square with ragged or rounded corners is still
        one), a disc fills less and at least ``min_disc_fill`` of its box (pi / 4 when sharp); a box
        whose sides differ by more than ``max_aspect``, or too small to have corners, is no shape."""
        from scipy import ndimage

        mask = ndimage.binary_fill_holes(mask)
        h, w = mask.shape
        area = mask.sum()
        fill = float(area / (h * w))
        top = float(mask[: h // 2].sum() + (mask[h // 2].sum() / 2 if h % 2 else 0)) / float(area)
        if max(h, w) > self.max_aspect * min(h, w):
            return None, fill, top
        if top < self.max_top_share:
            return "triangle", fill, top
        yy, xx = np.mgrid[0:h, 0:w] + 0.5
        corners = ((2 * yy / h - 1) ** 2 + (2 * xx / w - 1) ** 2) > 1
        if not corners.any():  # a box of at most 3 x 3 px: too small to tell a square from a disc
            return None, fill, top
        if mask[corners].mean() >= self.min_corner_fill:
            return "square", fill, top
        return ("circle" if fill >= self.min_disc_fill else None), fill, top

    def judge(self, image: np.ndarray, caption: str) -> Verdict:
        """The verdict on one image (uint8 or float 0-255 ``[3, H, W]``) for ``caption``. ``KeyError``
        naming the caption when it is not one of the grammar's (:func:`~pretrain.data.shapes.spec_for_caption`)."""
        spec = grammar.spec_for_caption(caption)
        objects = self.detect(image)
        items = score_items(spec, objects or [])
        if objects is None:
            items = {k: 0.0 for k in items}
        partial = float(np.mean(list(items.values())))
        return Verdict(float(all(v == 1.0 for v in items.values())), partial, spec.category, objects, items)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> list[Verdict]:
        """Verdicts for float ``[B, 3, H, W]`` images in [0, 1] and their ``prompts``. ``ValueError`` for
        another shape or a prompt count that differs; ``KeyError`` naming a caption outside the grammar."""
        if images.ndim != 4 or images.shape[1] != 3 or len(prompts) != images.shape[0]:
            raise ValueError(f"shapes judge: expects images [B, 3, H, W] and B prompts, got "
                             f"{tuple(images.shape)} and {len(prompts)} prompts")
        arr = (torch.nan_to_num(images.detach().float(), 0.0).clamp(0, 1) * 255).round().byte().cpu().numpy()
        return [self.judge(a, p) for a, p in zip(arr, prompts)]


def _relation(a: Detected, b: Detected, relation: str) -> bool:
    dy, dx = b.cy - a.cy, b.cx - a.cx
    if relation in ("left of", "right of"):
        return (dx > 0 if relation == "left of" else dx < 0) and abs(dx) > abs(dy)
    return (dy > 0 if relation == "above" else dy < 0) and abs(dy) > abs(dx)


def score_items(spec: grammar.SceneSpec, objects: list[Detected]) -> dict[str, float]:
    """Each requirement item of ``spec`` scored in [0, 1] against the detected ``objects`` (see the
    module docstring). Keys name the item, e.g. ``"0:shape"``, ``"0:colour"``, ``"0:count"``,
    ``"relation"``."""
    items: dict[str, float] = {}
    for i, req in enumerate(spec.objects):
        any_colour = sum(o.shape == req.shape for o in objects)
        bound = sum(o.shape == req.shape and (req.colour is None or o.colour == req.colour) for o in objects)
        items[f"{i}:shape"] = min(any_colour, req.count) / req.count
        if req.colour is not None:
            items[f"{i}:colour"] = min(bound, req.count) / req.count
        if req.exact:
            items[f"{i}:count"] = max(0.0, 1.0 - abs(bound - req.count) / req.count)
    if spec.relation:
        a_req, b_req = spec.objects
        match = lambda o, r: o.shape == r.shape and o.colour == r.colour  # noqa: E731
        items["relation"] = float(any(_relation(a, b, spec.relation) for a in objects if match(a, a_req)
                                      for b in objects if match(b, b_req) and b is not a))
    return items


@register("shapes")
class ShapesReward:
    """The shapes judge as a reward: float32 ``[B]`` of the partial score (``metric: partial``, for
    training) or strict correctness (``metric: strict``, GenEval's accuracy). Images float ``[B, 3, H, W]``
    in [0, 1]; prompts must be captions of the shapes grammar (``KeyError`` naming one that is not).
    :meth:`categories` gives each prompt's GenEval category (the evaluation's per-category table)."""

    def __init__(self, metric: str = "partial", **thresholds):
        if metric not in ("partial", "strict"):
            raise ValueError(f"rewards.shapes.metric: 'partial' or 'strict', got '{metric}'")
        self.metric, self.judge = metric, ShapesJudge(**thresholds)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        verdicts = self.judge(images, list(prompts))
        return torch.tensor([getattr(v, self.metric) for v in verdicts], dtype=torch.float32)

    @staticmethod
    def categories(prompts: list[str]) -> list[str]:
        """The GenEval category of each prompt (``KeyError`` for a caption outside the grammar)."""
        return [grammar.spec_for_caption(p).category for p in prompts]


@register("shapes_strict")
def shapes_strict(images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
    """GenEval's strict accuracy on the shapes task (1.0 when every requirement is met, else 0.0): the
    ``shapes`` reward with ``metric: strict``. float32 ``[B]``."""
    return ShapesReward("strict")(images, prompts, metadata)


shapes_strict.categories = ShapesReward.categories  # type: ignore[attr-defined]


@register("shapes_edit")
class ShapesEditReward:
    """The exact judge of the shapes editing task (:mod:`pretrain.data.shapes` (its edits)): a prompt
    ``"<source caption>; <instruction>"`` is looked up (``KeyError`` naming one the grammar cannot
    produce) and the image judged against its target scene's caption, whose requirements keep every
    object the instruction leaves alone. float32 ``[B]`` of the partial score (``metric: partial``) or
    strict correctness (``metric: strict``); images float ``[B, 3, H, W]`` in [0, 1]. :meth:`categories`
    gives each prompt's edit kind (``colour`` or ``shape``) for the evaluation's per-category table.
    ``preserve`` in [0, 1] (default 0) mixes in how much of the source is kept: the score is
    ``(1 - preserve) * judge + preserve * preserved`` with ``preserved`` of :func:`preserved_fraction`,
    which reads each sample's source image from ``metadata["source_images"]`` (``ValueError`` naming the
    key when it is missing)."""

    def __init__(self, metric: str = "partial", preserve: float = 0.0, **thresholds):
        if not 0.0 <= preserve <= 1.0:
            raise ValueError(f"rewards.shapes_edit.preserve: must be in [0, 1], got {preserve}")
        self.inner, self.preserve = ShapesReward(metric, **thresholds), preserve

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        from pretrain.data.shapes import edit_for_prompt

        score = self.inner(images, [edit_for_prompt(p).target.caption for p in prompts], metadata)
        if self.preserve == 0.0:
            return score
        kept = preserved_fraction(images, source_images(metadata, "shapes_edit"), prompts, self.inner.judge)
        return (1.0 - self.preserve) * score + self.preserve * kept

    @staticmethod
    def categories(prompts: list[str]) -> list[str]:
        from pretrain.data.shapes import edit_for_prompt

        return [edit_for_prompt(p).op for p in prompts]


@register("shapes_edit_strict")
def shapes_edit_strict(images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
    """Strict correctness of an edit (``shapes_edit`` with ``metric: strict``). float32 ``[B]``."""
    return ShapesEditReward("strict")(images, prompts, metadata)


shapes_edit_strict.categories = ShapesEditReward.categories  # type: ignore[attr-defined]


def source_images(metadata: dict | None, reward: str) -> torch.Tensor:
    """``metadata["source_images"]`` (float ``[B, 3, H, W]`` in [0, 1]); ``ValueError`` naming the key and
    ``reward`` when the caller gave none (the prompts carry no conditioning images)."""
    if not metadata or metadata.get("source_images") is None:
        raise ValueError(f"rewards.{reward}: needs metadata['source_images'] (each sample's source image); this "
                         "caller's prompts carry no conditioning images")
    return metadata["source_images"]


def edit_box(judge: ShapesJudge, label: np.ndarray, colour: str, shape: str, margin: int) -> np.ndarray:
    """bool ``[H, W]``: the bounding boxes, grown by ``margin`` px, of the components of the source's palette
    labels ``label`` (int ``[H, W]``, :meth:`ShapesJudge.pixel_labels`) in ``colour`` whose shape reads as
    ``shape``: where the edited object is, and where its edited form may be drawn
    (:func:`pretrain.data.shapes.render_edit` keeps the placement)."""
    from scipy import ndimage

    box = np.zeros(label.shape, bool)
    comps, _ = ndimage.label(label == _NAMES.index(colour))
    for i, sl in enumerate(ndimage.find_objects(comps), start=1):
        if judge._shape(comps[sl] == i)[0] == shape:
            rows = slice(max(0, sl[0].start - margin), sl[0].stop + margin)
            box[rows, max(0, sl[1].start - margin):sl[1].stop + margin] = True
    return box


def preserved_fraction(images: torch.Tensor, sources: torch.Tensor, prompts: list[str],
                       judge: ShapesJudge | None = None) -> torch.Tensor:
    """float32 ``[B]`` in [0, 1]: the share of pixels outside the edited object's box (:func:`edit_box`,
    2 px margin at 32 px) whose palette label (:meth:`ShapesJudge.pixel_labels`: a colour, the background or
    none) is the source's. 1.0 for the exact target render; an edit drawn on another object, a moved or an
    added one lowers it. ``images``, ``sources``: float ``[B, 3, H, W]`` in [0, 1]; ``prompts``: edit
    prompts (``KeyError`` naming one outside the grammar); ``ValueError`` when the shapes differ."""
    from pretrain.data.shapes import edit_for_prompt

    if images.shape != sources.shape:
        raise ValueError(f"rewards.shapes_edit: source_images {tuple(sources.shape)} do not match the images "
                         f"{tuple(images.shape)}")
    judge = judge or ShapesJudge()
    gen = (images.detach().float().clamp(0, 1) * 255).cpu().numpy()
    src = (sources.detach().float().clamp(0, 1) * 255).cpu().numpy()
    margin = max(1, round(2 * images.shape[-1] / 32))
    out = []
    for g, s, p in zip(gen, src, prompts):
        e = edit_for_prompt(p)
        before = e.source.objects[e.index]
        label = judge.pixel_labels(s.transpose(1, 2, 0))
        outside = ~edit_box(judge, label, before.colour, before.shape, margin)
        same = judge.pixel_labels(g.transpose(1, 2, 0)) == label
        out.append(float(same[outside].mean()) if outside.any() else 0.0)
    return torch.tensor(out, dtype=torch.float32)


@register("shapes_edit_preserved")
def shapes_edit_preserved(images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
    """How much of the source an edit keeps (:func:`preserved_fraction`), float32 ``[B]`` in [0, 1]; reads
    ``metadata["source_images"]`` (``ValueError`` naming the key without it)."""
    return preserved_fraction(images, source_images(metadata, "shapes_edit_preserved"), prompts)


shapes_edit_preserved.categories = ShapesEditReward.categories  # type: ignore[attr-defined]
