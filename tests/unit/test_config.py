import pytest

from posttrain.cli import main
from tests.conftest import ROOT

TINY = str(ROOT / "configs/pretrain/emoji_tiny.yaml")


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_unknown_key_in_file_names_key_and_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  layers: 3\n")
    code, err = run_cli(capsys, "pretrain", str(bad))
    assert code == 2
    assert "model.layers" in err and str(bad) in err


def test_wrong_type_names_key_and_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: many\n")
    code, err = run_cli(capsys, "pretrain", str(bad))
    assert code == 2
    assert "train.steps" in err and str(bad) in err


def test_missing_file(tmp_path, capsys):
    code, err = run_cli(capsys, "pretrain", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml" in err and "not found" in err


def test_bad_override_names_the_key(capsys):
    code, err = run_cli(capsys, "pretrain", TINY, "optim.learning_rate=3")
    assert code == 2 and "optim.learning_rate" in err and "command line" in err


def test_every_shipped_config_loads():
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig

    for path in sorted((ROOT / "configs/pretrain").glob("*.yaml")):
        cfg = load_config(PretrainConfig, path)
        assert cfg.train.steps > 0, path


def test_unknown_preset_is_a_clear_error():
    from pretrain.models import ModelConfig, build_transformer

    with pytest.raises(ValueError, match="model.preset"):
        build_transformer(ModelConfig(preset="huge"), 16, 3, 384, 384)
