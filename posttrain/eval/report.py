"""`posttrain report RUN_DIR`: one page for a run. ``RUN_DIR/report.md`` holds, per stage, a PNG of its
training curves (``report_<stage>.png``, from the stage's ``metrics.jsonl``) with a table of first and
last values, then the evaluation: its table, its sampling settings (steps, guidance, seed, samples per
prompt, models) and one PNG setting the models' grids side by side prompt by prompt with the prompts
written out in full (``report_eval_grids.png``).

RUN_DIR is a pipeline run folder (stage subfolders such as ``pretrain/``, ``grpo/``, ``dpo/``, and
``eval/``, written by :func:`posttrain.pipeline.run_pipeline`, which calls :func:`write_report` at its
end) or a single stage's folder (its own ``metrics.jsonl``). Evaluations written before ``eval.json``
existed get their settings from ``RUN_DIR/pipeline.yaml`` and keep their grids' own (shortened) captions.
"""

from __future__ import annotations

import json
import math
import re
import os
import sys
from pathlib import Path

import numpy as np

from posttrain.eval.plots import Series, grid_cells, plot_stage, read_series, side_by_side


def find_stages(run: Path) -> list[tuple[str, Path]]:
    """(name, folder) of each stage of ``run`` that has a ``metrics.jsonl``: ``run`` itself when it has
    one, else its subfolders, in the order of ``run/pipeline.yaml``'s stages (a named stage's folder is
    ``<name>/<command>``, shown as "name: command"), then the rest by name."""
    if (run / "metrics.jsonl").is_file():
        return [(run.name or str(run), run)]
    order = {}
    for s in _pipeline_yaml(run).get("stages") or []:
        if isinstance(s, dict) and s.get("command"):
            named, command = s.get("name"), s["command"]
            order[f"{named}: {command}" if named else command] = f"{named}/{command}" if named else command
    found = {d.name: d.name for d in sorted(run.iterdir()) if (d / "metrics.jsonl").is_file()}
    stages = {label: rel for label, rel in order.items() if (run / rel / "metrics.jsonl").is_file()}
    stages.update({n: n for n in found if n not in stages.values()})
    return [(label, run / rel) for label, rel in stages.items()]


def _pipeline_yaml(run: Path) -> dict:
    import yaml

    path = run / "pipeline.yaml"
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    return data if isinstance(data, dict) else {}


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.4g}"


def stage_section(name: str, folder: Path, run: Path) -> tuple[list[str], Path | None, Series]:
    """Markdown lines of one stage, the PNG written (None when it has nothing to plot) and the plotted
    lines ({key: (x, y)}, see :func:`plot_stage`)."""
    series = read_series(folder / "metrics.jsonl")
    lines = [f"## {name}", "", f"`{folder / 'metrics.jsonl'}`: curves against the step; \"nan\" values are gaps.", ""]
    png = run / f"report_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
    try:
        drawn = plot_stage(series, png, f"{name}: {folder}")
    except ValueError as e:
        return lines + [f"Nothing to plot: {e}.", ""], None, {}
    lines += ["| metric | points | NaN | first | last | min | max |", "|---|---|---|---|---|---|---|"]
    for key, (x, y) in drawn.items():
        fin = y[np.isfinite(y)]
        first, last = (_fmt(fin[0]), _fmt(fin[-1])) if fin.size else ("-", "-")
        lo, hi = (_fmt(fin.min()), _fmt(fin.max())) if fin.size else ("-", "-")
        lines.append(f"| {key} | {len(y)} | {int(np.isnan(y).sum())} | {first} | {last} | {lo} | {hi} |")
    return lines + ["", f"![{name} curves]({png.name})", ""], png, drawn


def _legacy_settings(run: Path) -> tuple[str | None, int | None]:
    """The sampling-settings line and the grid's cell count from ``run/pipeline.yaml``'s ``eval`` block
    (defaults of :class:`posttrain.eval.evaluate.EvalConfig` for keys it leaves out); (None, None) without one."""
    from dataclasses import asdict

    from posttrain.eval.evaluate import EvalConfig

    block = _pipeline_yaml(run).get("eval")
    if not isinstance(block, dict):
        return None, None
    e = {**asdict(EvalConfig()), **block}
    line = (f"sampling (from `pipeline.yaml`): ODE, {e['num_inference_steps']} steps, guidance {e['guidance_scale']}, "
            f"seed {e['seed']}, {e['samples_per_prompt']} sample(s) per prompt, prompts from {e['prompts']}")
    return line, min(int(e["grid_prompts"]), int(e["num_prompts"]))


def eval_section(eval_dir: Path, run: Path) -> tuple[list[str], Path | None]:
    """Markdown lines of the evaluation in ``eval_dir`` (its ``report.md``: table, models, settings)
    and the side-by-side grid PNG written (None without ``grid_model0.png`` or when the grids do not
    split into cells)."""
    lines = ["## Evaluation", "", f"From `{eval_dir / 'report.md'}`: every model samples the same prompts with "
             "the same per-prompt seeds.", ""]
    text = (eval_dir / "report.md").read_text().rstrip()
    lines += [line if line.startswith("|") or not line else f"- {line}" for line in text.splitlines()]
    meta_path = eval_dir / "eval.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    n, cols = None, 8
    if meta is None:
        settings, n = _legacy_settings(run)
        if settings and "\nsampling:" not in "\n" + text:
            lines.append(f"- {settings}")
    grids: list[Path] = []  # grid_model0.png, grid_model1.png, ... up to the first missing one
    while (eval_dir / f"grid_model{len(grids)}.png").is_file() and (meta is None or len(grids) < len(meta["grids"])):
        grids.append(eval_dir / f"grid_model{len(grids)}.png")
    if not grids:
        return lines + [""], None
    models = meta["models"] if meta else [_model_line(text, i) for i in range(len(grids))]
    try:
        sources = None
        if meta:
            captions, span = list(meta["grid_prompts"]), int(meta.get("grid_span", 1))
            cells = [grid_cells(g, span * len(captions), int(meta.get("grid_cols", cols))) for g in grids]
            if span == 2:  # an edit's source, then its output (pretrain.grid.edit_cells)
                sources, cells = cells[0][0::2], [c[1::2] for c in cells]
        else:
            cells = [grid_cells(g, n, cols, captions=True) for g in grids]
            captions = [""] * len(cells[0])
    except ValueError as e:
        return lines + ["", f"Grids not combined: {e}.", ""], None
    png = side_by_side(cells, captions, models, run / "report_eval_grids.png", sources=sources)
    note = "" if meta else (" This evaluation predates `eval.json`, so its prompts are not recorded: each cell "
                            "keeps its grid's own shortened caption; evaluate again for full captions.")
    order = "source image, then its models" if sources else "models"
    return lines + ["", f"The grids side by side, each prompt's {order} left to right (model 0 first).{note}", "",
                    f"![before and after]({png.name})", ""], png


def _model_line(text: str, i: int) -> str:
    prefix = f"model {i}: "
    return next((line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)), f"model {i}")


def write_report(run_dir: str | Path) -> dict:
    """Write ``RUN_DIR/report.md`` and its PNGs. Returns {"report": path, "pngs": [paths], "plotted":
    {stage: {key: (x, y)}}}. ``FileNotFoundError`` naming the path when ``run_dir`` is missing, not a
    folder, or holds neither a ``metrics.jsonl`` (itself or in a subfolder) nor ``eval/report.md``."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"report: RUN_DIR '{run}' is not a folder")
    stages = find_stages(run)
    eval_dir = run / "eval"
    has_eval = (eval_dir / "report.md").is_file()
    if not stages and not has_eval:
        raise FileNotFoundError(f"report: '{run}' holds no metrics.jsonl (itself or in a stage subfolder) "
                                f"and no eval/report.md")
    lines = [f"# Run report: {run}", "", "Stages: " + (", ".join(n for n, _ in stages) or "none") + ".", ""]
    pngs, plotted = [], {}
    for name, folder in stages:
        section, png, drawn = stage_section(name, folder, run)
        lines += section
        plotted[name] = drawn
        pngs += [png] if png else []
    if has_eval:
        section, png = eval_section(eval_dir, run)
        lines += section
        pngs += [png] if png else []
    path = run / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return {"report": path, "pngs": pngs, "plotted": plotted}


def report_after_run(run_dir: str | Path) -> Path | None:
    """:func:`write_report` at the end of a stage or pipeline, on rank 0 only (under torchrun); a failure
    is printed to stderr and returns None: plots never cost a finished run its exit status."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        report = write_report(run_dir)["report"]
    except Exception as err:  # noqa: BLE001
        print(f"report: not written: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None
    print(f"report: {report}", flush=True)
    return report
