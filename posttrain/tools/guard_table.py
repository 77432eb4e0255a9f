"""``python -m posttrain.tools.guard_table RUN_DIR``: the guard's checks of a post-training stage as a
markdown table: per check, the step, the trained reward (``guard/trained``), each guard reward and the
held-out loss, each as its value and its change from the baseline check, and whether the check failed.
It answers "did the trained reward and the judges part, and from which step"."""

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
        cells = [f"{r[n]:.4f} ({r[n] - base[n]:+.4f})" if isinstance(r.get(n), (int, float)) else "" for n in names]
        lines.append(f"| {r.get('step', '')} | " + " | ".join(cells) + f" | {int(r.get('guard/failing', 0))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m posttrain.tools.guard_table RUN_DIR", file=sys.stderr)
        return 2
    print(guard_table(guard_rows(Path(argv[0]) / "metrics.jsonl")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
