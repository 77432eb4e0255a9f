"""The report of `posttrain curate`: ``report.md`` with the counts per rule, score histograms (kept vs
dropped, one PNG per score), a grid of the best kept samples, one of dropped samples with their
reasons, and one of near-duplicate pairs (kept | dropped)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import OmegaConf

from posttrain.eval.plots import pyplot
from pretrain.grid import grid_image

if TYPE_CHECKING:
    from posttrain.curate.stage import Curation, CurateConfig

COLS = 8
CELL_PX = 128  # grid cells are upscaled (nearest) to at least this many pixels: ~21 caption characters


def histogram(path: Path, name: str, values: np.ndarray, groups: dict[str, np.ndarray]) -> Path:
    """PNG of the finite ``values`` (float ``[N]``) of each group (label -> bool mask ``[N]``, e.g. kept,
    dropped by a rule, dropped as a duplicate) overlaid on shared bins; the title counts the NaN ("not
    applicable") ones."""
    plt = pyplot()
    finite = np.isfinite(values)
    fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    if finite.any():
        lo, hi = values[finite].min(), values[finite].max()
        bins = np.linspace(lo, hi if hi > lo else lo + 1, 41)
        for (label, mask), color in zip(groups.items(), ("tab:green", "tab:red", "tab:orange", "tab:gray")):
            v = values[mask & finite]
            ax.hist(v, bins=bins, alpha=0.5, color=color, label=f"{label} ({len(v)})")
        ax.legend(fontsize=8)
    ax.set_title(f"{name}" + (f" ({int((~finite).sum())} not applicable)" if not finite.all() else ""))
    ax.set_xlabel("score")
    ax.set_ylabel("samples")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _grid(path: Path, images, idx: list[int], labels: list[str]) -> Path:
    """Cells ``images[idx]`` (uint8 ``[N, 3, H, W]``) with ``labels`` under them; a blank cell when empty."""
    import torch

    if not idx:
        cells, labels = torch.ones(1, *images.shape[1:]), ["(none)"]
    else:
        cells = images[torch.as_tensor(idx)].float() / 255.0
    grid_image(cells, labels, COLS, max(1, math.ceil(CELL_PX / images.shape[-1]))).save(path)
    return path


def _spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (all when there are fewer)."""
    if len(items) <= n:
        return items
    return [items[round(k * (len(items) - 1) / max(1, n - 1))] for k in range(n)]


def dropped_cells(result: Curation, n: int) -> list[int]:
    """Up to ``n`` dropped samples, taken in turn from each reason (a rule's outcome, or duplicate), each
    reason's samples evenly spaced over its total scores (highest first)."""
    groups: dict[str, list[int]] = {}
    total = np.nan_to_num(result.scores["total"], nan=-np.inf)
    for i in sorted(np.flatnonzero(~result.kept).tolist(), key=lambda i: (-total[i], i)):
        reason = result.reasons[i] or ""
        groups.setdefault("dup" if reason.startswith("dup") else reason, []).append(i)
    per = {k: _spread(v, n) for k, v in groups.items()}
    out: list[int] = []
    for k in range(n):
        out += [v[k] for v in per.values() if k < len(v)]
    return out[:n]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(root: Path, cfg: CurateConfig, result: Curation, data: Path) -> Path:
    """Write ``root/report.md``, ``root/hist_<score>.png`` (``total`` and each reward),
    ``root/grid_kept.png`` (the ``cfg.grid_samples`` kept samples of highest total, captioned
    "<total> <caption>"), ``root/grid_dropped.png`` (:func:`dropped_cells`, captioned by reason) and
    ``root/grid_duplicates.png`` (near-duplicate pairs, kept then dropped). ``data``: the output folder
    named in the report. Returns the report's path."""
    kept, scores, caps = result.kept, result.scores, result.captions
    n, n_kept = len(kept), int(kept.sum())
    dup = np.zeros(n, dtype=bool)
    dup[list(result.duplicates)] = True
    groups = {"kept": kept, "dropped by a rule": ~kept & ~dup, "dropped as a duplicate": dup}
    hists = [histogram(root / f"hist_{name}.png", name, v, groups) for name, v in scores.items()]
    total = np.nan_to_num(scores["total"], nan=-np.inf)
    best = sorted(np.flatnonzero(kept).tolist(), key=lambda i: (-total[i], i))[:cfg.grid_samples]
    _grid(root / "grid_kept.png", result.images, best, [f"{scores['total'][i]:.3g} {caps[i]}" for i in best])
    gone = dropped_cells(result, cfg.grid_samples)
    _grid(root / "grid_dropped.png", result.images, gone, [result.reasons[i] or "" for i in gone])
    pairs = _spread(sorted(result.duplicates.items(), key=lambda p: (-p[1][1], p[0])), cfg.grid_samples // 2)
    cells = [i for d, (k, _) in pairs for i in (k, d)]
    labels = [t for d, (k, dist) in pairs for t in (f"#{k} {caps[k]}", f"d={dist} {caps[d]}")]
    _grid(root / "grid_duplicates.png", result.images, cells, labels)

    lines = [f"# Curation: {cfg.run_dir}", "",
             f"Source: `data.source: {cfg.data.source}`" + (f" (`{cfg.data.path}`)" if cfg.data.path else "") +
             f" at {cfg.data.size} px; its train split ({n} samples) was scored, filtered and deduplicated. "
             f"The held-out split ({result.heldout} samples) was left out: it is not in the output and stays "
             "the evaluation set.", "",
             f"Output: `{data}`: **{n_kept}** samples ("
             + (f"WebDataset tar shards of {cfg.shard_size}; read them with `data.source: shards`"
                if cfg.shard_size else "`captions.jsonl` + `images/`; read it with `data.source: folder`")
             + f", `data.path: {data}`).", "",
             "## Counts", "",
             "| step | rule | reached | kept | dropped | not applicable |", "|---|---|---:|---:|---:|---:|"]
    for k, r in enumerate(result.rules, 1):
        lines.append(f"| r{k} | {r['rule']} | {r['reached']} | {r['kept']} | {r['dropped']} | "
                     f"{r['not_applicable']} |")
    if cfg.dedup.method != "none":
        reached = n_kept + len(result.duplicates)
        lines.append(f"| dedup | {cfg.dedup.method}, hash_size {cfg.dedup.hash_size}, max_distance "
                     f"{cfg.dedup.max_distance} | {reached} | {n_kept} | {len(result.duplicates)} | |")
    lines += [f"| output | | {n} | {n_kept} | {n - n_kept} | |", "",
              "A sample is dropped by the first rule it fails; a NaN score fails a rule as \"not applicable\". "
              "Near-duplicates are looked for among the samples every rule kept; of each pair the higher "
              "total stays.", "", "## Scores", "",
              "| score | kept mean | dropped mean | min | max | not applicable |", "|---|---:|---:|---:|---:|---:|"]
    for name, v in scores.items():
        f = np.isfinite(v)
        mean = lambda m: f"{v[m & f].mean():.4g}" if (m & f).any() else "-"  # noqa: E731
        lo, hi = (f"{v[f].min():.4g}", f"{v[f].max():.4g}") if f.any() else ("-", "-")
        lines.append(f"| {name} | {mean(kept)} | {mean(~kept)} | {lo} | {hi} | {int((~f).sum())} |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in hists]
    lines += ["", f"## Kept: the {len(best)} highest totals", "", "![kept](grid_kept.png)", "",
              f"## Dropped: {len(gone)} of {n - n_kept}, by reason", "", "![dropped](grid_dropped.png)", "",
              "| cell | caption | reason | total |", "|---:|---|---|---:|"]
    lines += [f"| {c} | {_md(caps[i])} | {result.reasons[i]} | {scores['total'][i]:.4g} |"
              for c, i in enumerate(gone)]
    if cfg.dedup.method != "none":
        lines += ["", f"## Near-duplicates: {len(pairs)} of {len(result.duplicates)} pairs (kept, dropped)", "",
                  "![duplicates](grid_duplicates.png)", "", "| kept | dropped | distance |", "|---|---|---:|"]
        lines += [f"| #{k} {_md(caps[k])} | #{d} {_md(caps[d])} | {dist} |" for d, (k, dist) in pairs]
    lines += ["", "## Seconds", "", "| phase | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result.seconds.items()]
    lines += ["", "## Config", "", "```yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).rstrip(), "```", ""]
    path = root / "report.md"
    path.write_text("\n".join(lines))
    return path
