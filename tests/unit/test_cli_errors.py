"""The CLI's answers to mistakes: a key typo before torch loads, YAML errors with line and column, a
rewards block replaced with ``~rewards``, ``--resume`` with nothing to resume, an out-of-range stage,
the help texts, printed paths and an undefined z."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import KEYS, build_parser, main, shown_path
from posttrain.eval.evaluate import z_text
from pretrain.config import ConfigError, load_config
from pretrain.config_keys import check_keys, key_tree
from tests.conftest import ROOT

pytestmark = pytest.mark.core

SMALL = str(ROOT / "configs/pretrain/emoji_small.yaml")
GRPO_TINY = str(ROOT / "configs/grpo/emoji_tiny.yaml")


def test_a_key_typo_is_answered_before_torch_is_imported():
    code = ("import sys; from posttrain.cli import main; rc = main(['pretrain', %r, 'no_such.key=1']); "
            "print(rc, 'torch' in sys.modules, 'diffusers' in sys.modules)" % SMALL)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("config error: command line: key 'no_such': Key 'no_such' not in "
                                                    "'PretrainConfig' (in 'no_such.key=1')")


@pytest.mark.parametrize("command,path,override", [("pretrain", SMALL, "train.stepz=1"),
                                                   ("grpo", GRPO_TINY, "rollout.group_sise=4"),
                                                   ("grpo", GRPO_TINY, "no_such=1")])
def test_the_early_key_check_says_what_the_full_load_says(command, path, override):
    from posttrain.stages import get_stage

    with pytest.raises(ConfigError) as early:
        check_keys(KEYS, command, path, [override])
    with pytest.raises(ConfigError) as full:
        load_config(get_stage(command)[0], path, [override])
    assert str(early.value) == str(full.value)


def test_the_recorded_key_trees_match_the_schemas_and_pass_every_shipped_config():
    from posttrain.stages import STAGES, get_stage

    recorded = json.loads(KEYS.read_text())
    for command in STAGES:  # when this fails: python scripts/write_config_keys.py
        assert recorded[command] == key_tree(get_stage(command)[0]), command
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        command = path.relative_to(ROOT / "configs").parts[0]
        if command in STAGES:
            check_keys(KEYS, command, path, ["~rewards", "rewards.x=1"] if command == "grpo" else [])


def test_yaml_syntax_errors_name_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: runs/x\ntrain: {steps: 3\noptim: {lr: 1}\n")
    assert main(["pretrain", str(bad)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"config error: {bad}:3:6: not valid YAML: did not find expected ',' or '}}' (while parsing a flow mapping "
        f"at line 2, column 8)")


def test_rewards_block_is_replaced_with_tilde_and_a_merge_is_warned(caplog):
    from posttrain.grpo.stage import GRPOConfig

    with caplog.at_level(logging.WARNING):
        merged = load_config(GRPOConfig, GRPO_TINY, ["rewards={jpeg_incompressibility: 1}"])
    assert merged.rewards == {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 1}
    assert ("command line: 'rewards={jpeg_incompressibility: 1}' merges into rewards, which keeps jpeg_compressibility "
            f"from {GRPO_TINY}; to replace the block, put '~rewards' before it") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert load_config(GRPOConfig, GRPO_TINY, ["~rewards", "rewards={jpeg_incompressibility: 1}"]).rewards == {
            "jpeg_incompressibility": 1}
        assert load_config(GRPOConfig, GRPO_TINY, ["~rewards", "rewards.jpeg_incompressibility=2"]).rewards == {
            "jpeg_incompressibility": 2}
        assert load_config(GRPOConfig, GRPO_TINY, ["rewards.jpeg_compressibility=2"]).rewards == {
            "jpeg_compressibility": 2}
    assert "merges" not in caplog.text
    with pytest.raises(ConfigError, match="does not support deletion"):
        load_config(GRPOConfig, GRPO_TINY, ["~train"])  # a structured block is not emptied


def test_resume_with_nothing_to_resume_exits_2_before_training(tmp_path, capsys):
    run = tmp_path / "never_ran"
    args = ["pretrain", str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={run}", "--resume"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"config error: --resume: no checkpoint to resume from in {run / 'pretrain/checkpoints'} (the run_dir does "
        f"not exist); drop --resume to start a new run, or pass --resume=auto to start one when there is nothing "
        f"to resume")
    assert not run.exists()


def test_an_out_of_range_pipeline_stage_names_the_stage_count():
    from posttrain.pipeline import PipelineConfig

    with pytest.raises(ConfigError, match=r"^command line: 'stages.5.command=grpo': no stages.5: the pipeline has 3 "
                                          r"stage\(s\) \(indices 0 to 2\)$"):
        load_config(PipelineConfig, ROOT / "configs/quickstart.yaml", ["stages.5.command=grpo"])


def test_help_texts(capsys):
    parser = build_parser()
    assert parser.description.endswith("1 run failure.") and "Exit codes:" in parser.description
    with pytest.raises(SystemExit):
        parser.parse_args(["curate", "x.yaml", "--resume"])  # curate has no checkpoints, so no --resume
    assert "unrecognized arguments: --resume" in capsys.readouterr().err
    assert parser.parse_args(["grpo", "x.yaml", "--resume"]).resume == "yes"
    assert parser.parse_args(["grpo", "x.yaml"]).resume is None


def test_printed_paths_have_no_dot_dot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run/pretrain/export").mkdir(parents=True)
    assert shown_path(Path("run/pretrain/export") / ".." / "samples" / "a.png") == "run/pretrain/samples/a.png"
    assert shown_path(tmp_path.parent / "x" / ".." / "y.png") == str(tmp_path.parent / "y.png")


def test_z_is_honest_when_the_se_is_zero_or_undefined():
    assert z_text(0.5, 0.25) == "+2.0"
    assert z_text(0.0, 0.0) == "n/a (SE 0, no difference)"
    assert z_text(-0.1, 0.0) == "-inf (SE 0)"
    assert z_text(0.1, float("nan")) == "n/a"
