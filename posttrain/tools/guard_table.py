"""``python -m posttrain.tools.guard_table STAGE_DIR``: the guard's checks of a post-training stage as a
markdown table: per check, the step, the trained reward (``guard/trained``), each guard reward and the
held-out loss, each as its value and its change from the baseline check, and how many guards failed
(``guard/failing``). It answers "did the trained reward and the judges part, and from which step".
``STAGE_DIR`` is the stage's folder (``<run_dir>/grpo``, holding ``metrics.jsonl``); a run folder
with one ``grpo`` or ``dpo`` stage folder also works."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SKIP = {"guard/diversity", "guard/failing", "guard/streak", "guard/best_step", "guard/seconds"}


def guard_rows(metrics_path: str | Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` that carry a guard check (``guard/trained``), in order.
    ``FileNotFoundError`` naming the file when it is missing."""
    path = Path(metrics_path)
    if not path.is_file():
        raise FileNotFoundError(f"guard_table: {path} not found (a GRPO / DPO stage folder with guard.every > 0)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "guard/trained" in r]


def guard_table(rows: list[dict]) -> str:
    """Markdown: one line per check, columns the trained reward, every guard value (categories left out)
    and failing; each value with its change from the first (baseline) check."""
    if not rows:
        return "(no guard checks)"
    names = ["guard/trained"] + sorted(k for k in rows[0] if k.startswith("guard/") and k.count("/") == 1
                                       and k not in SKIP and k != "guard/trained")
    head = "| step | " + " | ".join(n.removeprefix("guard/") for n in names) + " | failing |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    base = rows[0]
    for r in rows:
        cells = [_cell(r.get(n), base.get(n)) for n in names]
        lines.append(f"| {r.get('step', '')} | " + " | ".join(cells) + f" | {int(r.get('guard/failing', 0))} |")
    return "\n".join(lines)


def _cell(value, base) -> str:
    """``value (change from base)``; the value alone when the baseline is not a number (a NaN is
    logged as the string "nan"), empty when the value is not a number either."""
    if not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if not isinstance(base, (int, float)):
        return f"{value:.4f}"
    return f"{value:.4f} ({value - base:+.4f})"


def metrics_file(folder: str | Path) -> Path:
    """``folder/metrics.jsonl``, or that of its one ``grpo`` / ``dpo`` stage folder when ``folder`` is a
    run folder (the first that exists; the first candidate when none does)."""
    folder = Path(folder)
    candidates = [folder / "metrics.jsonl", folder / "grpo" / "metrics.jsonl", folder / "dpo" / "metrics.jsonl"]
    return next((c for c in candidates if c.is_file()), candidates[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m posttrain.tools.guard_table STAGE_DIR", file=sys.stderr)
        return 2
    try:
        print(guard_table(guard_rows(metrics_file(argv[0]))))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
