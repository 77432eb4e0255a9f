"""Reward config entries: ``name: weight`` or ``name: {weight, <params>}``, import-path user rewards,
and the errors that name the entry."""

import sys
import textwrap

import pytest
import torch

from rewards.base import CompositeReward, build_reward, check_reward_weights, known_rewards, parse_reward_specs
from rewards.jpeg import jpeg_size_kb
from rewards.specs import RewardSpec

pytestmark = pytest.mark.core

USER_MODULE = '''
import torch

def brightness(images, prompts=None, metadata=None, gain=1.0):
    return gain * images.float().mean(dim=(1, 2, 3))

class Channel:
    def __init__(self, channel: int, scale: float = 1.0):
        self.channel, self.scale = channel, scale
    def __call__(self, images, prompts=None, metadata=None):
        return self.scale * images[:, self.channel].float().mean(dim=(1, 2))

def make_constant(value):
    return lambda images, prompts=None, metadata=None: torch.full((images.shape[0],), float(value))

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (pkg / "broken.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_pkg.my_rewards"
    for name in [m for m in sys.modules if m.startswith("my_pkg")]:
        del sys.modules[name]


def images(n=4):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, 8, 8, generator=g)


def test_parse_both_forms():
    specs = parse_reward_specs({"a": 2, "b": {"weight": 0.5, "path": "/m", "scale": 100}, "c": {"path": "/x"}})
    assert specs == {"a": RewardSpec("a", 2.0, {}), "b": RewardSpec("b", 0.5, {"path": "/m", "scale": 100}),
                     "c": RewardSpec("c", 1.0, {"path": "/x"})}


@pytest.mark.parametrize("config,match", [
    ({"a": "heavy"}, r"rewards\.a: the weight must be a number"),
    ({"a": {"weight": "x"}}, r"rewards\.a\.weight: the weight must be a number"),
    ({"a": True}, r"rewards\.a: the weight must be a number"),
    (["a"], r"rewards: expected a mapping"),
])
def test_parse_errors_name_the_entry(config, match):
    with pytest.raises(ValueError, match=match):
        parse_reward_specs(config)


def test_import_path_function_class_and_factory(user_pkg):
    x = images()
    mean = x.mean(dim=(1, 2, 3))
    total, raw = CompositeReward({f"{user_pkg}:brightness": 1.0,
                                  f"{user_pkg}:Channel": {"weight": 2.0, "channel": 1, "scale": 3.0},
                                  f"{user_pkg}:make_constant": {"weight": 1.0, "value": 7}})(x, ["p"] * 4)
    torch.testing.assert_close(raw[f"{user_pkg}:brightness"], mean)
    torch.testing.assert_close(raw[f"{user_pkg}:Channel"], 3.0 * x[:, 1].mean(dim=(1, 2)))
    torch.testing.assert_close(raw[f"{user_pkg}:make_constant"], torch.full((4,), 7.0))
    want = (mean + 2 * 3.0 * x[:, 1].mean(dim=(1, 2)) + 7.0)  # all present: weighted sum, no renormalisation
    torch.testing.assert_close(total, want)
    # a plain reward function receives its parameters as keyword arguments
    torch.testing.assert_close(build_reward(f"{user_pkg}:brightness", gain=2.0)(x, None), 2 * mean)


def test_registered_reward_with_parameters():
    x = images()
    total, raw = CompositeReward({"jpeg_compressibility": {"weight": 1.0, "quality": 50}})(x, ["p"] * 4)
    torch.testing.assert_close(raw["jpeg_compressibility"], -jpeg_size_kb(x, 50))
    assert not torch.equal(jpeg_size_kb(x, 50), jpeg_size_kb(x, 95))


def test_check_accepts_importable_paths_and_builtins(user_pkg):
    check_reward_weights({f"{user_pkg}:Channel": {"weight": 1.0, "channel": 0}, "jpeg_compressibility": 0.5})
    for name in ("ocr", "clip_score", "pickscore", "aesthetic", "hpsv2", "imagereward"):
        assert name in known_rewards()


@pytest.mark.parametrize("entry,match", [
    ("my_pkg.nope:fn", r"rewards\.my_pkg\.nope:fn: cannot import module 'my_pkg\.nope'"),
    ("my_pkg.broken:fn", r"rewards\.my_pkg\.broken:fn: cannot import module .*no_such_module_anywhere"),
    ("my_pkg.my_rewards:missing", r"rewards\.my_pkg\.my_rewards:missing: module 'my_pkg\.my_rewards' has no "
                                  r"attribute 'missing'"),
    ("my_pkg.my_rewards:NOT_CALLABLE", r"rewards\.my_pkg\.my_rewards:NOT_CALLABLE: 'NOT_CALLABLE' is not callable"),
    ("my_pkg.my_rewards:", r"rewards\.my_pkg\.my_rewards:: an import path must look like"),
    ("no_such_reward", r"rewards: unknown reward\(s\) \['no_such_reward'\]"),
])
def test_resolution_errors_name_the_key(user_pkg, entry, match):
    with pytest.raises(ValueError, match=match):
        check_reward_weights({entry: 1.0})
    with pytest.raises(ValueError, match=match):
        CompositeReward({entry: 1.0})


@pytest.mark.parametrize("entry,params", [
    ("my_pkg.my_rewards:Channel", {"colour": 1}),        # unknown keyword
    ("my_pkg.my_rewards:Channel", {}),                    # missing required 'channel'
    ("my_pkg.my_rewards:brightness", {"nope": 1}),        # plain function: unknown keyword
    ("jpeg_compressibility", {"qualty": 90}),             # built-in: typo
])
def test_bad_parameters_name_the_key(user_pkg, entry, params):
    with pytest.raises(ValueError, match=rf"rewards\.{entry}: bad parameters"):
        check_reward_weights({entry: {"weight": 1.0, **params}})


def test_zero_weights_are_not_built_and_all_zero_is_an_error(user_pkg):
    comp = CompositeReward({"jpeg_compressibility": 1.0, "my_pkg.my_rewards:Channel": {"weight": 0, "channel": 9}})
    assert list(comp.models) == ["jpeg_compressibility"]
    with pytest.raises(ValueError, match="non-zero weight"):
        check_reward_weights({"jpeg_compressibility": {"weight": 0}})


def test_grpo_config_takes_the_mapping_form(tmp_path, user_pkg):
    from pretrain.config import ConfigError, load_config
    from posttrain.grpo.stage import GRPOConfig

    path = tmp_path / "g.yaml"
    path.write_text(f"model: {{pretrained: {tmp_path}}}\n"
                    f"rewards:\n  jpeg_compressibility: 1.0\n  {user_pkg}:Channel: {{weight: 0.5, channel: 2}}\n")
    cfg = load_config(GRPOConfig, path, ["rewards.jpeg_compressibility=0.25"])
    specs = parse_reward_specs(cfg.rewards)
    assert specs["jpeg_compressibility"].weight == 0.25
    assert specs[f"{user_pkg}:Channel"] == RewardSpec(f"{user_pkg}:Channel", 0.5, {"channel": 2})
    with pytest.raises(ConfigError, match=r"rewards\.my_pkg\.my_rewards:Channel: bad parameters"):
        load_config(GRPOConfig, path, [f"rewards[{user_pkg}:Channel].chanel=1"])  # brackets: a dotted name
    off = load_config(GRPOConfig, path, [f"rewards[{user_pkg}:Channel].weight=0"])
    assert parse_reward_specs(off.rewards)[f"{user_pkg}:Channel"].weight == 0
