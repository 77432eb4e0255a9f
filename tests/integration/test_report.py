"""`posttrain report RUN_DIR`: the curves drawn are the values in each stage's metrics.jsonl ("nan" as gaps),
report.md links every PNG, the evaluation's settings are recorded, and the grids are re-laid side by side."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.cli import main
from posttrain.eval.evaluate import report_table
from posttrain.eval.report import write_report
from posttrain.eval.plots import grid_cells
from pretrain.sampling import save_grid

pytestmark = pytest.mark.core

NAN = "nan"
PROMPTS = ["a very long prompt about a smiling yellow face with tears of joy and sunglasses", "red apple",
           "flag: united kingdom of great britain and northern ireland", "rocket"]


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _fake_run(root, eval_json=True):
    """A pipeline run folder: pretrain and grpo metrics (with "nan" strings, a non-numeric key and a
    torn last line), and an eval folder with two grids of the same four prompts."""
    pre = [{"step": 0, "heldout_loss": 2.0}]
    pre += [{"step": s, "loss": 2.0 / s, "samples_per_s": 40.0 + s, "nonfinite": ""} for s in range(1, 7)]
    pre[3]["loss"] = NAN
    pre.append({"step": 6, "heldout_loss": 0.5})
    grpo = []
    for s in range(1, 6):
        grpo.append({"step": s, "reward_mean": 0.1 * s, "reward/jpeg_compressibility_mean": -1.5 + 0.05 * s,
                     "reward/jpeg_compressibility_std": 0.1, "reward/ocr_mean": 0.2 * s, "kl": 0.001 * s,
                     "approx_kl": 1e-7, "clip_frac": 0.05, "ratio_min": 0.99, "ratio_mean": 1.0, "ratio_max": 1.01,
                     "samples_per_s": 2.0, "loss": 1e-4, "guard/flow_loss": 0.2 + 0.01 * s, "nonfinite": "ocr"})
    grpo[2]["kl"] = NAN
    grpo[1]["reward/ocr_mean"] = NAN
    grpo[4]["guard/flow_loss"] = NAN
    _write_jsonl(root / "pretrain/metrics.jsonl", pre)
    _write_jsonl(root / "grpo/metrics.jsonl", grpo)
    with (root / "grpo/metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "reward_me')  # torn by a kill mid-write
    (root / "pipeline.yaml").write_text("stages:\n- {command: pretrain}\n- {command: grpo}\n"
                                        "eval: {num_prompts: 4, grid_prompts: 4, num_inference_steps: 7, seed: 3}\n")
    ev = root / "eval"
    gen = torch.Generator().manual_seed(0)
    images = [torch.rand(4, 3, 8, 8, generator=gen) for _ in range(2)]
    grids = [str(save_grid(im, PROMPTS, ev / f"grid_model{i}.png", cols=3)) for i, im in enumerate(images)]
    models = [str(root / "pretrain/export"), str(root / "grpo/export")]
    settings = {"sampler": "ODE", "num_inference_steps": 7, "guidance_scale": 4.0, "seed": 3, "samples_per_prompt": 1,
                "prompts": "heldout"}
    results = {"models": models, "prompts": PROMPTS, "grids": grids, "guard": [0.2, 0.25],
               "rewards": {"jpeg_compressibility": [torch.full((4, 1), -1.5), torch.full((4, 1), -1.2)]}}
    if eval_json:
        results["settings"] = settings
        (ev / "eval.json").write_text(json.dumps({"models": models, "settings": settings, "prompts": PROMPTS,
                                                  "grids": grids, "grid_prompts": PROMPTS, "grid_cols": 3}))
    (ev / "report.md").write_text(report_table(results) + "\n")
    return images


def _expected(path):
    """{key: (steps, values)} read independently of the report: numbers and "nan" strings only."""
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        for k, v in rec.items():
            if k != "step" and (isinstance(v, (int, float)) or v == NAN):
                xs, ys = out.setdefault(k, ([], []))
                xs.append(rec["step"])
                ys.append(math.nan if v == NAN else v)
    return out


def test_report_plots_every_metric_as_logged_and_links_the_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run)
    assert main(["report", str(run)]) == 0
    assert f"report: {run / 'report.md'}" in capsys.readouterr().out
    out = write_report(run)
    for stage in ("pretrain", "grpo"):
        want = _expected(run / stage / "metrics.jsonl")
        drawn = out["plotted"][stage]
        plotted = set(want)
        if stage == "grpo":
            assert "reward/jpeg_compressibility_std" in plotted  # drawn as a band, not a line
            plotted.discard("reward/jpeg_compressibility_std")
        assert set(drawn) == plotted, stage
        for key, (x, y) in drawn.items():
            np.testing.assert_array_equal(x, want[key][0], err_msg=f"{stage} {key}")
            np.testing.assert_array_equal(y, want[key][1], err_msg=f"{stage} {key}")  # NaN where "nan"
    assert np.isnan(out["plotted"]["grpo"]["kl"][1][2]) and np.isnan(out["plotted"]["pretrain"]["loss"][1][2])
    assert np.isnan(out["plotted"]["grpo"]["guard/flow_loss"][1][4])

    text = (run / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(p.name for p in out["pngs"])
    assert set(links) == {"report_pretrain.png", "report_grpo.png", "report_eval_grids.png"}
    assert all((run / name).is_file() and (run / name).read_bytes()[:4] == b"\x89PNG" for name in links)
    assert "sampling: ODE, 7 steps, guidance 4.0, seed 3" in text and "| jpeg_compressibility (mean) |" in text
    assert text.index("## pretrain") < text.index("## grpo") < text.index("## Evaluation")


def test_grids_are_cut_into_their_cells_and_combined_with_full_captions(tmp_path):
    run = tmp_path / "run"
    images = _fake_run(run)
    for m, im in enumerate(images):
        cells = grid_cells(run / f"eval/grid_model{m}.png", 4, 3)
        assert [c.size for c in cells] == [(24, 24)] * 4  # 8 px x scale 3, caption strip cut off
        for c, img in zip(cells, im):
            want = (img.clamp(0, 1) * 255).round().byte().repeat_interleave(3, 1).repeat_interleave(3, 2)
            assert torch.equal(torch.from_numpy(np.array(c)).permute(2, 0, 1), want)
        assert len(grid_cells(run / f"eval/grid_model{m}.png", cols=3)) == 4  # inferred: square cells
    from PIL import Image

    write_report(run)
    combined = Image.open(run / "report_eval_grids.png")
    assert combined.width >= 4 * 2 * 24 and combined.height > 24 + 3 * 16  # 4 pairs, caption lines under


def test_an_older_eval_gets_its_settings_from_pipeline_yaml(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, eval_json=False)
    text = (run / write_report(run)["report"].name).read_text()
    assert "sampling (from `pipeline.yaml`): ODE, 7 steps, guidance 4.0, seed 3" in text
    assert "report_eval_grids.png" in text


def test_a_single_stage_folder_is_a_run(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    out = write_report(run / "grpo")
    assert [p.name for p in out["pngs"]] == ["report_grpo.png"] and (run / "grpo/report.md").is_file()


@pytest.mark.parametrize("make", [False, True], ids=["missing", "empty"])
def test_missing_or_empty_run_dir_is_an_error_naming_it(tmp_path, capsys, make):
    run = tmp_path / "nothing"
    if make:
        run.mkdir()
    assert main(["report", str(run)]) == 1
    assert str(run) in capsys.readouterr().err


def test_a_pipeline_ends_with_the_report(tmp_path, monkeypatch):
    from dataclasses import dataclass

    from posttrain import pipeline as pipeline_mod
    from posttrain.pipeline import PipelineConfig, StageConfig, run_pipeline

    @dataclass
    class Fake:
        run_dir: str = ""

    def train(cfg):  # a stage that only logs
        _write_jsonl(Path(cfg.run_dir) / "pretrain/metrics.jsonl", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": NAN}])
        return Path(cfg.run_dir) / "pretrain/export"

    monkeypatch.setattr(pipeline_mod, "get_stage", lambda name: (Fake, train))
    (tmp_path / "fake.yaml").write_text("{}\n")
    run = tmp_path / "run"
    out = run_pipeline(PipelineConfig(run_dir=str(run), evaluate=False,
                                      stages=[StageConfig(command="pretrain", config=str(tmp_path / "fake.yaml"))]))
    assert out["report"] == run / "report.md" and "![pretrain curves](report_pretrain.png)" in out["report"].read_text()


def test_a_named_stage_is_found_under_its_name_in_pipeline_order(tmp_path):
    """A pipeline's named stage writes ``<name>/<command>/``: the report finds it there, labels it
    "name: command", keeps the pipeline's order, and names its plot without the colon."""
    import yaml

    from posttrain.eval.report import find_stages, stage_section

    run = tmp_path / "run"
    for rel in ("pretrain", "reward_gradient", "refresh/train-reward", "refresh/reward_gradient"):
        (run / rel).mkdir(parents=True)
        (run / rel / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    stages = [{"command": "pretrain"}, {"command": "reward_gradient"},
              {"command": "train-reward", "name": "refresh"}, {"command": "reward_gradient", "name": "refresh"}]
    (run / "pipeline.yaml").write_text(yaml.safe_dump({"stages": stages}))
    found = find_stages(run)
    assert [label for label, _ in found] == ["pretrain", "reward_gradient", "refresh: train-reward",
                                             "refresh: reward_gradient"]
    assert found[3][1] == run / "refresh" / "reward_gradient"
    _, png, _ = stage_section(*found[3], run)
    assert png == run / "report_refresh_reward_gradient.png" and png.is_file()
