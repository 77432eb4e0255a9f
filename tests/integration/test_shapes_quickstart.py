"""The quickstart's own config (configs/quickstart.yaml: shapes pretrain -> the judge's learned stand-in ->
ReFL through it -> paired evaluation by the exact judge and the stand-in) at tiny size: every piece of the
path it takes runs, and what it reports is consistent (per-category rows, per-category guard curves,
pass/fail frames that match the judge)."""

import pytest
import json

import numpy as np
import yaml
from PIL import Image

from posttrain.cli import main
from pretrain.data import shapes as grammar
from pretrain.grid import FAIL_RGB, PASS_RGB
from tests.conftest import ROOT

pytestmark = pytest.mark.core

TINY_DATA = ["data.scenes=256", "data.heldout_per_category=2"]


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_quickstart_config_at_tiny_size(tmp_path, capsys):
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["stages"][0]["overrides"] = ["train.steps=4", "model.preset=tiny", "eval.every=0", "eval.grid_every=0",
                                     *TINY_DATA]
    cfg["stages"][1]["overrides"] = ["judge.generated=16", "judge.heldout_generated=8", "judge.num_inference_steps=3",
                                     "train.epochs=1", "data.scenes=256", "data.heldout_per_category=2"]
    cfg["stages"][2]["overrides"] += ["train.steps=2", "train.batch_size=4", "sampling.num_inference_steps=3",
                                      "guard.every=1", "guard.num_prompts=12", "guard.num_inference_steps=3",
                                      "guard.loss_samples=8", "checkpoint.every=2", *TINY_DATA]
    cfg["eval"] |= {"num_prompts": 12, "samples_per_prompt": 1, "num_inference_steps": 3, "guard_samples": 8,
                    "grid_prompts": 12}
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", str(path)]) == 0
    run = tmp_path / "run"
    table = (run / "eval/report.md").read_text()
    for cat in grammar.CATEGORIES:
        assert f"| shapes_strict: {cat} (" in table and f"| shapes: {cat} (" in table
    assert f"| learned_judge@{run}/train-reward/model (mean) |" in table  # the stand-in it trained on, beside
    assert all("data_loss" in r for r in rows_of(run / "reward_gradient/metrics.jsonl") if "reward" in r)
    # the guard logged strict accuracy per category at every check (0 = baseline, 1, 2)
    rows = rows_of(run / "reward_gradient/metrics.jsonl")
    checks = [r for r in rows if "guard/shapes_strict" in r]
    assert [r["step"] for r in checks] == [0, 1, 2]
    assert all(0.0 <= r[f"guard/shapes_strict/{c}"] <= 1.0 for r in checks for c in grammar.CATEGORIES)
    # every grid cell is framed, green where the judge passed it and red where it failed
    ev = json.loads((run / "eval/eval.json").read_text())
    grid = np.asarray(Image.open(run / "eval/grid_model0.png").convert("RGB"))
    corners = {tuple(int(v) for v in grid[(i // 8) * (32 * 3 + 12), (i % 8) * 32 * 3]) for i in range(12)}
    assert corners <= {PASS_RGB, FAIL_RGB} and len(ev["grid_prompts"]) == 12
    assert "shapes_strict (mean)" in capsys.readouterr().out
