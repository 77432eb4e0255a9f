"""perf.preset sets the options measured fastest on a kind of machine, only where they are still at
their defaults; an unknown preset is a config error naming the key."""

import pytest

from posttrain.perf import PRESETS, PerfConfig, resolve_perf
from pretrain.config import ConfigError


def test_presets_set_their_options_and_explicit_values_win():
    cpu = resolve_perf(PerfConfig(preset="cpu"), "fp32", False)
    assert (cpu.compile, cpu.reward_workers, cpu.sigmoid_gelu, cpu.merge_lora) == (True, 0, True, True)
    assert cpu.transitions_per_forward == 1  # not in the cpu preset: activation traffic costs on a CPU
    kept = resolve_perf(PerfConfig(preset="cpu", reward_workers=3, sigmoid_gelu=False), "fp32", False)
    assert (kept.compile, kept.reward_workers, kept.sigmoid_gelu) == (True, 3, False)
    small = resolve_perf(PerfConfig(preset="gpu_small"), "bf16", False)
    assert (small.compile, small.transitions_per_forward, small.merge_lora) == (True, 0, False)
    none = resolve_perf(PerfConfig(), "fp32", False)
    assert (none.compile, none.sigmoid_gelu, none.reward_workers) == (False, False, 1)
    assert set(PRESETS) == {"cpu", "gpu", "gpu_small"}


def test_unknown_preset_is_a_config_error_naming_the_key(tmp_path):
    from posttrain.grpo import GRPOConfig
    from pretrain.config import load_config

    with pytest.raises(ConfigError, match=r"perf\.preset: unknown 'laptop'; known: none, cpu, gpu, gpu_small"):
        load_config(GRPOConfig, None, [f"run_dir={tmp_path}", "model.pretrained=x", "perf.preset=laptop"])
