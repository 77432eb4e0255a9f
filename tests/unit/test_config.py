import pytest

from posttrain.cli import main
from pretrain.config import ConfigError
from tests.conftest import ROOT

pytestmark = pytest.mark.core

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


def missing_keys(path) -> list[str]:
    """Dotted keys a shipped config leaves as ``???`` (the local folders a user fills in)."""
    from omegaconf import OmegaConf

    return sorted(OmegaConf.missing_keys(OmegaConf.load(path)))


def placeholder(key: str, tmp_path) -> str:
    """A value for a blank key: a prompt folder for ``data.path`` (its existence is checked at load),
    a path otherwise (model folders are opened only when the run starts)."""
    if key == "data.path":
        prompts = tmp_path / "prompts"
        prompts.mkdir(exist_ok=True)
        (prompts / "train.txt").write_text("a photo of a cat\n")
        return str(prompts)
    return f"/path/to/{key.replace('.', '_')}"


def test_a_load_leaves_the_cached_defaults_as_they_were(tmp_path):
    """Every load starts from one cached tree of a schema's defaults: what a load without a file overrides
    or removes (``~rewards``) must not reach the next load."""
    from posttrain.stages import get_stage
    from pretrain.config import load_config

    schema, path = get_stage("grpo")[0], ROOT / "configs/grpo/emoji_tiny.yaml"
    plain = load_config(schema, path)
    changed = load_config(schema, None, [f"model.pretrained={tmp_path}", "~rewards",
                                         "rewards={jpeg_compressibility: 2.0}", "train.steps=7",
                                         "optim.betas=[0.5,0.5]"])
    assert changed.rewards == {"jpeg_compressibility": 2.0} and changed.train.steps == 7
    assert changed.optim.betas == [0.5, 0.5]
    again = load_config(schema, path)
    assert again == plain and again.optim.betas == [0.9, 0.999] and again.rewards == plain.rewards
    assert again.optim.betas is not plain.optim.betas  # each load has its own objects


def test_every_shipped_config_loads(tmp_path):
    from posttrain.pipeline import PipelineConfig
    from posttrain.stages import get_stage
    from posttrain.tools.train_reward import TrainRewardConfig
    from pretrain.config import load_config

    bench_data = tmp_path / "data"  # what the benchmark writes before loading its config
    bench_data.mkdir()
    (bench_data / "captions.jsonl").write_text("")
    paths = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(paths) >= 6
    for path in paths:
        if path.parent.name == "bench":  # its data folder is built by the benchmark
            with pytest.raises(ConfigError, match="data.path"):
                load_config(get_stage("grpo")[0], path, ["data.path=/nonexistent/data"])
            load_config(get_stage("grpo")[0], path, [f"data.path={bench_data}"])
            continue
        folder = {"ddpo": "grpo"}.get(path.parent.name, path.parent.name)  # GRPO-stage configs
        if folder == "reward":  # `posttrain train-reward` configs
            schema = TrainRewardConfig
        elif folder == "sweep":  # `posttrain sweep` configs: the file and every arm's config under every task
            from posttrain.tools.sweep_config import SweepConfig, arm_config

            cfg = load_config(SweepConfig, path)
            for task in cfg.tasks:
                for arm in cfg.arms:
                    arm_config(cfg, task, arm, cfg.seeds[0])
            continue
        else:
            schema = PipelineConfig if folder == "configs" else get_stage(folder)[0]
        if schema is PipelineConfig:  # and every stage, as the pipeline validates them before training
            from posttrain.pipeline import plan

            plan(load_config(schema, path))
            continue
        blanks = missing_keys(path)  # real-model configs: local folders the user fills in
        if blanks:
            with pytest.raises(ConfigError) as err:
                load_config(schema, path)
            assert any(key in str(err.value) for key in blanks), (path, blanks, err.value)
            load_config(schema, path, [f"{key}={placeholder(key, tmp_path)}" for key in blanks])
        else:
            load_config(schema, path)


GRPO_TINY = str(ROOT / "configs/grpo/emoji_tiny.yaml")


@pytest.mark.parametrize("override,key", [
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.noise_level=0", "rollout.noise_level"),
    ("rollout.timestep_fraction=0", "rollout.timestep_fraction"),
    ("rollout.timestep_selection=some", "rollout.timestep_selection"),
    ("rollout.ode_solver=heun", "rollout.ode_solver"),
    ("rollout.ode_solver=dpmpp_2m", "rollout.ode_solver"),  # without an sde_window
    ("train.batch_size=0", "train.batch_size"),
    ("train.batch_size=3", "train.batch_size"),
    ("rewards.no_such_reward=1.0", "rewards"),
    ("rewards.jpeg_compressibility=0", "rewards"),
    ("optim.schedule=linear", "optim.schedule"),
    ("model.pretrained=null", "model.pretrained"),
    ("train.precision=fp8", "train.precision"),
    ("engine.name=spark", "engine.name"),
    ("engine.mode=one_step_off", "engine.mode"),  # the local engine samples on the trainer's ranks
    ("engine.workers=0", "engine.workers"),
])
def test_grpo_config_errors_exit_2_before_any_work(capsys, override, key):
    code, err = run_cli(capsys, "grpo", GRPO_TINY, override)
    assert code == 2, err
    assert key in err and "emoji_tiny.yaml" in err


@pytest.mark.parametrize("override,new", [("rollout.engine=ray", "engine.name"),
                                          ("rollout.workers=2", "engine.workers"), ("rollout.mode=async", "engine.mode")])
def test_an_engine_key_under_rollout_is_unknown_and_names_its_new_key(capsys, override, new):
    code, err = run_cli(capsys, "grpo", GRPO_TINY, override)
    assert code == 2, err
    assert f"key '{override.partition('=')[0]}'" in err and f"moved to '{new}'" in err


def _schema_and_config(command):
    from posttrain.dpo.stage import DPOConfig
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.trainer import PretrainConfig

    return {"pretrain": (PretrainConfig, TINY, []),
            "grpo": (GRPOConfig, GRPO_TINY, ["model.pretrained=/x"]),
            "dpo": (DPOConfig, str(ROOT / "configs/dpo/emoji_tiny.yaml"), ["model.pretrained=/x"])}[command]


@pytest.mark.parametrize("command", ["pretrain", "grpo", "dpo"])
@pytest.mark.parametrize("override,key,says", [
    ("data.source=foo", "data.source", "unknown source 'foo' (known: openmoji, moving_emoji, folder, prompts, shapes, shapes_edit, shards, latent_cache)"),
    ("data.source=folder", "data.path", "required when data.source is 'folder'"),
    ("data.source=prompts", "data.path", "required when data.source is 'prompts'"),
    ("data.train_half=2", "data.train_half", "must be 0, 1 or null"),
    ("data.source=shards", "data.path", "required when data.source is 'shards'"),
    ("data.buckets=[[16,8]]", "data.buckets", "[[height, width], ...] of positive sizes, for source 'shards' only"),
    ("data.workers=-1", "data.workers", "must be >= 0"),
    ("optim.lr=nan", "optim.lr", "must be a finite number > 0, got nan"),
    ("optim.lr=inf", "optim.lr", "must be a finite number > 0, got inf"),
    ("optim.lr=0", "optim.lr", "must be a finite number > 0, got 0.0"),
    ("optim.lr=-1", "optim.lr", "must be a finite number > 0, got -1.0"),
])
def test_data_and_lr_errors_are_config_errors(command, override, key, says):
    from pretrain.config import load_config

    schema, path, extra = _schema_and_config(command)
    with pytest.raises(ConfigError) as e:
        load_config(schema, path, [*extra, override])
    assert f"{key}: {says}" in str(e.value)


def test_buckets_must_fit_the_model(tmp_path):
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig

    with pytest.raises(ConfigError, match=r"data.buckets: \[16, 32\] must be multiples of the patch size 4 and at "
                                          r"most data.size 16"):
        load_config(PretrainConfig, TINY, ["data.source=shards", f"data.path={tmp_path}", "data.buckets=[[16,32]]"])


@pytest.mark.parametrize("command", ["pretrain", "grpo", "dpo"])
def test_data_path_must_exist_at_config_load(command, tmp_path):
    from pretrain.config import load_config

    schema, path, extra = _schema_and_config(command)
    (tmp_path / "prompts.txt").write_text("a cat\n")
    (tmp_path / "images").mkdir()
    for data, says in ([f"data.path={tmp_path}/nowhere", "is not a folder"],
                       [f"data.path={tmp_path}/images", "has no captions.jsonl"],
                       [f"data.path={tmp_path}/prompts.txt", "is not a folder"]):
        with pytest.raises(ConfigError, match=f"data.path: '{data.split('=')[1]}' {says}"):
            load_config(schema, path, [*extra, "data.source=folder", data])
    with pytest.raises(ConfigError, match=f"data.path: '{tmp_path}/images' has no train.txt"):
        load_config(schema, path, [*extra, "data.source=prompts", f"data.path={tmp_path}/images"])
    with pytest.raises(ConfigError, match=f"data.path: '{tmp_path}/nowhere.txt' does not exist"):
        load_config(schema, path, [*extra, "data.source=prompts", f"data.path={tmp_path}/nowhere.txt"])
    (tmp_path / "images" / "captions.jsonl").write_text("")
    assert load_config(schema, path, [*extra, "data.source=folder", f"data.path={tmp_path}/images"]).data.path
    assert load_config(schema, path, [*extra, "data.source=prompts", f"data.path={tmp_path}/prompts.txt"]).data.path


def test_unknown_data_source_exits_2_before_any_loading(tmp_path, capsys, monkeypatch):
    import posttrain.base.stage as stage

    def no_loading(*args, **kwargs):
        raise AssertionError("the export was loaded before the config's own checks")

    monkeypatch.setattr(stage, "load_exported", no_loading)  # the config's own checks, no model or text encoder
    code, err = run_cli(capsys, "grpo", GRPO_TINY, "data.source=foo", f"model.pretrained={tmp_path}/no_export",
                        f"run_dir={tmp_path}/run")
    assert code == 2 and "data.source: unknown source 'foo'" in err, err
    assert not (tmp_path / "run").exists()
    code, err = run_cli(capsys, "pretrain", TINY, "data.source=folder", f"run_dir={tmp_path}/pre")
    assert code == 2 and "data.path: required" in err
    assert not (tmp_path / "pre").exists()


def test_missing_export_folder_exits_2(tmp_path, capsys):
    code, err = run_cli(capsys, "grpo", GRPO_TINY, f"model.pretrained={tmp_path}/nothing")
    assert code == 2 and "model.pretrained" in err and "not an export folder" in err


def test_pretrain_size_not_divisible_by_patch(capsys):
    code, err = run_cli(capsys, "pretrain", TINY, "data.size=15")
    assert code == 2 and "data.size" in err


def test_frame_code_on_an_image_codec_is_an_error(capsys):
    code, err = run_cli(capsys, "pretrain", TINY, "codec.frame_code=true")
    assert code == 2 and "codec.frame_code" in err and "patchify" in err


def test_sample_and_eval_reject_non_positive_counts(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["sample", str(tmp_path), "--prompts", "a", "--steps", "0"])
    assert e.value.code == 2
    for flag, value in (("--num-prompts", "0"), ("--guard-samples", "-1"), ("--grid-prompts", "0")):
        with pytest.raises(SystemExit) as e:
            main(["eval", str(tmp_path), flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    code, err = run_cli(capsys, "eval", str(tmp_path), "--rewards", "shapes_strict", "--mark", "shapes")
    assert code == 2 and "--mark: 'shapes' is not one of --rewards" in err


def test_unknown_preset_is_a_clear_error(capsys):
    code, err = run_cli(capsys, "pretrain", TINY, "model.preset=huge")
    assert code == 2 and "model.preset" in err and "huge" in err


def test_pipeline_with_an_unknown_eval_reward_fails_before_training(tmp_path, capsys):
    import yaml

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path), "eval": {"rewards": ["nope"]},
                                    "stages": [{"command": "pretrain", "config": TINY}]}))
    code, err = run_cli(capsys, "pipeline", str(path))
    assert code == 2 and "eval.rewards" in err
    assert not (tmp_path / "pretrain").exists()


def test_eval_cli_unknown_reward_exits_2(capsys, tmp_path):
    code, err = run_cli(capsys, "eval", str(tmp_path), "--rewards", "nope")
    assert code == 2 and "--rewards" in err


def test_command_line_override_indexes_a_list_of_stages():
    from posttrain.pipeline import PipelineConfig
    from pretrain.config import load_config

    path = ROOT / "configs/quickstart.yaml"
    cfg = load_config(PipelineConfig, path, ["stages.0.overrides=[train.steps=1, train.batch_size=4]"])
    assert cfg.stages[0].overrides == ["train.steps=1", "train.batch_size=4"]
    assert cfg.stages[1].command == "train-reward" and cfg.stages[1].overrides == ["judge.generated=2048"]  # kept
    with pytest.raises(ConfigError, match=r"'stages.5.overrides=.*': no stages.5: the pipeline has 3 stage"):
        load_config(PipelineConfig, path, ["stages.5.overrides=[train.steps=1]"])


def test_command_line_override_keeps_interpolations_and_names_bad_yaml():
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import load_config

    cfg = load_config(GRPOConfig, GRPO_TINY, ["model.pretrained=/x", "run_dir=${model.pretrained}/grpo_run"])
    assert cfg.run_dir == "/x/grpo_run"  # resolved against the whole config, not the override alone
    with pytest.raises(ConfigError, match=r"command line: .*in 'model.pretrained=\[1, 2'"):
        load_config(GRPOConfig, GRPO_TINY, ["model.pretrained=[1, 2"])
