"""The run report's images: one PNG of a stage's training curves (matplotlib, Agg backend) from its
``metrics.jsonl``, and one PNG that sets the evaluation's per-model grids side by side, prompt by
prompt, under wrapped (not truncated) prompt captions."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

GRID_LABEL_PX = 12  # the caption strip under each cell of pretrain.grid.grid_image
Series = dict[str, tuple[np.ndarray, np.ndarray]]


def _number(v) -> float | None:
    """A metric value as a float: numbers as they are, the strings the logger writes for non-finite
    values ("nan", "inf", "-inf") as those floats; None for anything else (e.g. ``nonfinite: ""``)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return f if not math.isfinite(f) else None
    return None


def read_series(path: str | Path) -> Series:
    """{key: (steps, values)} of every numeric key of a ``metrics.jsonl``, float arrays in file order;
    a key's steps are those of the records that hold a number for it. "nan"/"inf" strings become NaN
    (plotted as gaps), so ``values`` is finite or NaN. A line torn by a kill mid-write is skipped.
    ``FileNotFoundError`` for a missing file."""
    raw: dict[str, tuple[list[float], list[float]]] = {}
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        step = _number(rec.get("step"))
        if step is None:
            continue
        for key, v in rec.items():
            f = _number(v)
            if key == "step" or f is None:
                continue
            xs, ys = raw.setdefault(key, ([], []))
            xs.append(step)
            ys.append(f if math.isfinite(f) else math.nan)
    return {k: (np.asarray(x), np.asarray(y)) for k, (x, y) in raw.items()}


def panels(series: Series) -> list[tuple[str, list[str]]]:
    """The panels a stage's curves get, in order, as (title, metric keys), only for keys present:
    each reward (``reward/<name>_mean``, band from ``reward/<name>_std``; ``reward_mean``, the weighted
    total, unless it repeats a single named reward; ``online_reward_mean`` of online DPO), ``loss`` with
    ``heldout_loss``, DPO's implicit accuracy, ``kl``, ``approx_kl``, ``clip_frac``, the ratio range
    (``ratio_min``/``ratio_mean``/``ratio_max``), ``samples_per_s``, and each ``guard/<name>`` key, followed by
    one panel of its ``guard/<name>/<category>`` lines when the guard reward has categories."""
    named = sorted(k for k in series if re.fullmatch(r"reward/.+_mean", k))
    out = [(k.removesuffix("_mean"), [k]) for k in named]
    if "reward_mean" in series:
        x, y = series["reward_mean"]
        repeats = len(named) == 1 and np.array_equal(series[named[0]][0], x) and \
            np.allclose(series[named[0]][1], y, equal_nan=True)
        if not repeats:
            out.insert(0, ("reward (weighted total)", ["reward_mean"]))
    groups = (("online reward (DPO pairs)", ["online_reward_mean"]), ("loss", ["loss", "heldout_loss"]),
              ("implicit accuracy", ["implicit_acc", "heldout_implicit_acc"]), ("KL to the reference (kl)", ["kl"]),
              ("KL to the rollout policy (approx_kl)", ["approx_kl"]), ("clip fraction", ["clip_frac"]),
              ("ratio range", ["ratio_min", "ratio_mean", "ratio_max"]), ("samples / s", ["samples_per_s"]))
    out += [(title, [k for k in keys if k in series]) for title, keys in groups if any(k in series for k in keys)]
    per_category = {k.rsplit("/", 1)[0] for k in series if k.count("/") == 2 and k.startswith("guard/")}
    for k in sorted(k for k in series if k.startswith("guard/") and k.count("/") == 1):
        out.append((k, [k]))
        if k in per_category:  # guard/<reward>/<category>: one panel of every category's line
            out.append((f"{k} per category", sorted(c for c in series if c.startswith(k + "/"))))
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_stage(series: Series, path: str | Path, title: str) -> Series:
    """Write the stage's curves (:func:`panels`, three per row) against the step to ``path`` (PNG).
    Returns {metric key: (x, y)} of every line drawn, read back from the figure; NaN in y is a gap.
    ``ValueError`` when no key of :func:`panels` is in ``series``."""
    spec = panels(series)
    if not spec:
        raise ValueError(f"{title}: none of the plotted metrics (rewards, kl, clip_frac, ratios, samples_per_s, "
                         f"loss, guard/...) is in it")
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(spec))
    rows = math.ceil(len(spec) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False, layout="constrained")
    for ax, (name, keys) in zip(axes.flat, spec):
        if name == "ratio range" and "ratio_min" in keys and "ratio_max" in keys:
            (x, lo), (_, hi) = series["ratio_min"], series["ratio_max"]
            ax.fill_between(x, lo, hi, alpha=0.15, label="min .. max")
            ax.axhline(1.0, ls="--", c="gray", lw=1)
        for key in keys:
            x, y = series[key]
            marker = "o" if len(x) <= 60 else None
            ax.plot(x, y, label=key, lw=1.5, marker=marker, ms=3)
            std = series.get(key.removesuffix("_mean") + "_std") if key.startswith("reward/") else None
            if std is not None and np.array_equal(std[0], x):
                ax.fill_between(x, y - std[1], y + std[1], alpha=0.15, label="± " + key.removesuffix("_mean") + "_std")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(spec):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
    drawn = {line.get_label(): (np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float))
             for ax in axes.flat for line in ax.get_lines() if not line.get_label().startswith("_")}
    plt.close(fig)
    return drawn


def grid_cells(path: str | Path, n: int | None = None, cols: int = 8, captions: bool = False) -> list:
    """The cells of a grid PNG written by :func:`pretrain.sampling.save_grid` (``cols`` columns, each
    cell an image over a caption strip) as PIL images in grid order, without their caption strip unless
    ``captions``. ``n``: how many cells; None infers it for square cells (one row of up to ``cols``, or
    ``cols`` per row with trailing blank cells dropped). ``ValueError`` when the image does not split
    that way."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    w, h = img.size
    if n is None:
        side = h - GRID_LABEL_PX
        if side > 0 and w % side == 0 and w // side <= cols:
            n = cols = w // side
        else:
            side = w // cols
            rows, rest = divmod(h, side + GRID_LABEL_PX)
            if side <= 0 or rest or rows == 0:
                raise ValueError(f"{path}: {w}x{h} px is not a grid of square cells in {cols} columns")
            n = rows * cols
            while n > 1 and _blank(img, n - 1, cols, side, side + GRID_LABEL_PX):
                n -= 1
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    cw, rh = w // cols, h // rows
    if cw * cols != w or rh * rows != h or rh <= GRID_LABEL_PX:
        raise ValueError(f"{path}: {w}x{h} px does not split into {n} cells in {cols} columns")
    keep = rh if captions else rh - GRID_LABEL_PX
    return [img.crop((c * cw, r * rh, (c + 1) * cw, r * rh + keep))
            for r, c in (divmod(i, cols) for i in range(n))]


def _blank(img, i: int, cols: int, cw: int, rh: int) -> bool:
    r, c = divmod(i, cols)
    return min(img.crop((c * cw, r * rh, (c + 1) * cw, (r + 1) * rh)).convert("L").getextrema()) == 255


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """``text`` in lines no wider than ``width`` px (a word wider than that gets a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(lines[-1] + " " + word, font=font) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def side_by_side(cells: list[list], captions: list[str], labels: list[str], path: str | Path, *,
                 per_row: int = 4, font_size: int = 13, min_cell: int = 64, sources: list | None = None) -> Path:
    """Write one PNG comparing models prompt by prompt: ``cells[m][i]`` (PIL images, model m, prompt
    i) side by side in model order for each prompt, ``per_row`` prompts per row, each prompt's caption
    wrapped underneath in full; ``labels[m]`` names model m in a header. ``sources``: each prompt's
    conditioning image (an edit's source), shown first in its group. Cells narrower than ``min_cell`` px
    are upscaled (nearest) by a whole factor. Returns ``path``. ``ValueError`` when the models (or
    ``sources``) have different numbers of cells or ``captions`` another length."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(captions)
    if any(len(c) != n for c in cells) or len(labels) != len(cells) or n == 0 or (sources and len(sources) != n):
        raise ValueError(f"side_by_side: {[len(c) for c in cells]} cells per model, {n} captions, "
                         f"{len(labels)} labels" + (f", {len(sources)} sources" if sources else ""))
    names = [f"model {m}" for m in range(len(cells))]
    if sources:
        cells, names = [sources, *cells], ["source", *names]
    k = math.ceil(min_cell / cells[0][0].width)
    if k > 1:
        cells = [[c.resize((c.width * k, c.height * k), Image.NEAREST) for c in model] for model in cells]
    font = ImageFont.load_default(size=font_size)
    line_h, gap, pad = font_size + 3, 14, 6
    cw, ch = cells[0][0].size
    group_w = cw * len(cells)
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    wrapped = [_wrap(scratch, c, font, group_w) for c in captions]
    cols = max(1, min(per_row, n))
    rows = [list(range(s, min(n, s + cols))) for s in range(0, n, cols)]
    row_h = [line_h + ch + pad + line_h * max(len(wrapped[i]) for i in r) + gap for r in rows]
    width = cols * group_w + (cols - 1) * gap + 2 * pad
    header = _wrap(scratch, "Each prompt: " + ("its source image, then " if sources else "")
                   + ", ".join(f"model {m} = {lab}" for m, lab in enumerate(labels))
                   + " (left to right).", font, width - 2 * pad)
    top = pad + line_h * len(header) + pad
    img = Image.new("RGB", (width, top + sum(row_h)), "white")
    draw = ImageDraw.Draw(img)
    for k, line in enumerate(header):
        draw.text((pad, pad + k * line_h), line, fill=(0, 0, 0), font=font)
    y = top
    for r, height in zip(rows, row_h):
        for slot, i in enumerate(r):
            x = pad + slot * (group_w + gap)
            for m, model_cells in enumerate(cells):
                draw.text((x + m * cw + 2, y), names[m], fill=(90, 90, 90), font=font)
                img.paste(model_cells[i], (x + m * cw, y + line_h))
                draw.rectangle((x + m * cw, y + line_h, x + (m + 1) * cw - 1, y + line_h + ch - 1),
                               outline=(200, 200, 200))  # so a blank (white) sample still shows as a cell
            for k, line in enumerate(wrapped[i]):
                draw.text((x, y + line_h + ch + pad // 2 + k * line_h), line, fill=(0, 0, 0), font=font)
        y += height
    path = Path(path)
    img.save(path)
    return path
