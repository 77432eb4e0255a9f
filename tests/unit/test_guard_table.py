"""The guard table: one line per guard check with each value's change from the baseline check."""

import json

import pytest

from posttrain.tools.guard_table import guard_rows, guard_table, main

pytestmark = pytest.mark.core


def test_table_lines_and_changes_from_the_baseline(tmp_path, capsys):
    rows = [{"step": 1, "loss": 0.5},  # a training row without a check
            {"step": 0, "guard/trained": 0.5, "guard/shapes_strict": 0.4, "guard/loss": 0.07, "guard/failing": 0,
             "guard/shapes_strict/counting": 0.3, "guard/seconds": 3.0},
            {"step": 4, "guard/trained": 0.75, "guard/shapes_strict": 0.25, "guard/loss": 0.08, "guard/failing": 1}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [r["step"] for r in guard_rows(path)] == [0, 4]
    table = guard_table(guard_rows(path)).splitlines()
    assert table[0] == "| step | trained | loss | shapes_strict | failing |"  # no per-category or timing column
    assert table[3] == "| 4 | 0.7500 (+0.2500) | 0.0800 (+0.0100) | 0.2500 (-0.1500) | 1 |"
    assert main([str(tmp_path)]) == 0 and capsys.readouterr().out.splitlines()[2].startswith("| 0 | 0.5000 (+0.0000)")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        guard_rows(tmp_path / "nothing" / "metrics.jsonl")
    assert main([str(tmp_path / "nothing")]) == 2 and "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "run" / "grpo").mkdir(parents=True)  # a run folder with its stage folder
    (tmp_path / "run" / "grpo" / "metrics.jsonl").write_text(path.read_text())
    assert main([str(tmp_path / "run")]) == 0 and "| 4 | 0.7500 (+0.2500)" in capsys.readouterr().out


def test_a_nan_baseline_prints_the_value_without_a_change():
    rows = [{"step": 0, "guard/trained": "nan", "guard/loss": 0.07},
            {"step": 2, "guard/trained": 0.5, "guard/loss": 0.08}]
    assert guard_table(rows).splitlines()[3] == "| 2 | 0.5000 | 0.0800 (+0.0100) | 0 |"
