"""pretrain -> dpo -> grpo chained by the pipeline runner, then the paired evaluation."""

import pytest
import yaml

from posttrain.cli import main
from posttrain.eval.evaluate import EvalConfig, evaluate
from tests.conftest import ROOT

pytestmark = pytest.mark.core


def test_pipeline_chains_stages_and_evaluates(tmp_path, capsys):
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "stages": [
            {"command": "pretrain", "config": str(ROOT / "configs/pretrain/emoji_tiny.yaml"),
             "overrides": ["train.steps=10", "eval.every=0"]},
            {"command": "dpo", "config": str(ROOT / "configs/dpo/emoji_tiny.yaml"), "overrides": ["train.steps=2", "online.resample_every=2", "checkpoint.every=2"]},
            {"command": "grpo", "config": str(ROOT / "configs/grpo/emoji_tiny.yaml"), "overrides": ["train.steps=1"]},
        ],
        "eval": {"num_prompts": 8, "num_inference_steps": 4, "guard_samples": 16, "grid_prompts": 4},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", str(path)]) == 0
    run = tmp_path / "run"
    dpo_cfg = yaml.safe_load((run / "dpo/config.yaml").read_text())
    grpo_cfg = yaml.safe_load((run / "grpo/config.yaml").read_text())
    assert dpo_cfg["model"]["pretrained"] == str(run / "pretrain/export")
    assert grpo_cfg["model"]["pretrained"] == str(run / "dpo/export")
    report = (run / "eval/report.md").read_text()
    assert "jpeg_compressibility" in report and "guard: held-out flow-matching loss" in report
    assert all((run / f"eval/grid_model{i}.png").is_file() for i in range(3))
    out = capsys.readouterr().out
    assert "model 1 - model 0" in out and "model 2 - model 0" in out


def test_eval_of_a_model_against_itself_is_exactly_zero(tiny_export, tmp_path):
    res = evaluate([str(tiny_export), str(tiny_export)], EvalConfig(num_prompts=6, num_inference_steps=3,
                   samples_per_prompt=2, guard_samples=8, grid_prompts=2), tmp_path)
    a, b = res["rewards"]["jpeg_compressibility"]
    assert a.shape == (6, 2) and a.equal(b)  # same seeds, same model -> identical samples
    assert res["guard"][0] == res["guard"][1]
    assert "+0.0000 (0.0000)" in res["table"]


def test_unknown_stage_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path), "stages": [{"command": "ppo", "config": "x.yaml"}]}))
    assert main(["pipeline", str(path)]) == 2
    assert "stages.0.command" in capsys.readouterr().err


def test_pipeline_curates_then_midtrains_on_the_curated_folder(tmp_path, capsys):
    import json

    run = tmp_path / "run"
    cfg = {
        "run_dir": str(run),
        "evaluate": False,
        "stages": [
            {"command": "pretrain", "config": str(ROOT / "configs/pretrain/emoji_tiny.yaml"),
             "overrides": ["train.steps=4", "eval.every=0"]},
            {"command": "curate", "config": str(ROOT / "configs/curate/emoji_learned_clip.yaml"),
             "overrides": ["rewards.learned_clip.weight=0", "rewards.jpeg_compressibility=1.0", "data.limit=64",
                           "data.size=16"]},
            {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml"), "data_from": "curate",
             "overrides": ["train.steps=2", "data.heldout_fraction=0.3"]},
        ],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", str(path)]) == 0
    mid = yaml.safe_load((run / "midtrain/config.yaml").read_text())
    assert mid["model"]["pretrained"] == str(run / "pretrain/export")  # curate passes the export through
    assert mid["data"]["source"] == "folder" and mid["data"]["path"] == str(run / "curate/data")
    kept = [json.loads(line)["caption"] for line in (run / "curate/data/captions.jsonl").read_text().splitlines()]
    assert 0 < len(kept) <= 32  # the top half of the 64 train emoji, near-duplicates dropped
    assert (run / "midtrain/export/posttrain.json").is_file() and (run / "curate/report.md").is_file()
    assert "exports: " + str(run / "pretrain/export") + ", " + str(run / "midtrain/export") in capsys.readouterr().out


def test_data_from_must_name_an_earlier_data_stage(tmp_path, capsys):
    cfg = {"run_dir": str(tmp_path / "run"), "stages": [
        {"command": "pretrain", "config": str(ROOT / "configs/pretrain/emoji_tiny.yaml")},
        {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml"), "data_from": "curate"}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", str(path)]) == 2
    assert "stages.1.data_from: 'curate' is not an earlier data stage" in capsys.readouterr().err


def test_a_command_twice_needs_a_name_and_a_leading_data_stage_passes_its_export(tmp_path, capsys):
    """A second stage of one command is refused unless named; named, it writes under its name and the
    stage after it starts from its export."""
    from posttrain.pipeline import PipelineConfig, plan
    from pretrain.config import load_config

    run = tmp_path / "run"
    twice = {"run_dir": str(run), "stages": [
        {"command": "pretrain", "config": str(ROOT / "configs/pretrain/emoji_tiny.yaml")},
        {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml")},
        {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml")}]}
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(twice))
    assert main(["pipeline", str(path)]) == 2
    assert f"stages.2: 'midtrain' would write {run / 'midtrain'} a second time" in capsys.readouterr().err
    twice["stages"][2]["name"] = "round2"
    twice["stages"].append({"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml"),
                            "name": "round3"})
    path.write_text(yaml.safe_dump(twice))
    planned = plan(load_config(PipelineConfig, path))
    assert f"run_dir={run / 'round2'}" in planned[2].overrides
    assert f"model.pretrained={run / 'midtrain' / 'export'}" in planned[2].overrides
    assert f"model.pretrained={run / 'round2' / 'midtrain' / 'export'}" in planned[3].overrides
    twice["stages"][3]["name"] = "a/b"
    path.write_text(yaml.safe_dump(twice))
    assert main(["pipeline", str(path)]) == 2
    assert "stages.3.name: 'a/b' must be a plain folder name" in capsys.readouterr().err
    lead = {"run_dir": str(tmp_path / "run"), "stages": [
        {"command": "curate", "config": str(ROOT / "configs/curate/emoji_learned_clip.yaml"),
         "overrides": ["model.pretrained=/some/export"]},
        {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml"), "data_from": "curate"}]}
    path.write_text(yaml.safe_dump(lead))
    planned = plan(load_config(PipelineConfig, path))
    assert "model.pretrained=/some/export" in planned[1].overrides


def test_a_reward_stage_samples_the_export_before_it_and_passes_it_on(tmp_path):
    """``train-reward`` in a pipeline: its ``judge.generated_from`` is the export before it, its model goes
    to ``<run_dir>/train-reward/model``, and the stage after it continues from that same export."""
    from posttrain.pipeline import PipelineConfig, plan
    from pretrain.config import load_config

    run = tmp_path / "run"
    cfg = {"run_dir": str(run), "stages": [
        {"command": "pretrain", "config": str(ROOT / "configs/pretrain/shapes_small.yaml")},
        {"command": "train-reward", "config": str(ROOT / "configs/reward/shapes_judge.yaml")},
        {"command": "reward_gradient", "config": str(ROOT / "configs/reward_gradient/shapes_draft.yaml"),
         "overrides": [f"reward.learned_judge.path={run}/train-reward/model"]}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    planned = plan(load_config(PipelineConfig, path))
    export = run / "pretrain" / "export"
    assert planned[1].config.judge.generated_from == str(export)
    assert planned[1].config.folder() == run / "train-reward"
    assert planned[2].config.model.pretrained == str(export)
