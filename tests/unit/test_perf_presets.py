"""perf.preset sets the options measured fastest on a kind of machine, only where they are left unset
(any value given wins, the default's included); an unknown preset is a config error naming the key."""

import pytest

from posttrain.grpo.perf import PRESETS, PerfConfig, resolve_perf
from pretrain.config import ConfigError

pytestmark = pytest.mark.core


def test_presets_set_their_options_and_explicit_values_win():
    cpu = resolve_perf(PerfConfig(preset="cpu"), "fp32", False)
    assert (cpu.compile, cpu.reward_workers, cpu.sigmoid_gelu, cpu.merge_lora) == (True, 0, True, True)
    assert cpu.transitions_per_forward == 1  # not in the cpu preset: activation traffic costs on a CPU
    kept = resolve_perf(PerfConfig(preset="cpu", reward_workers=3, sigmoid_gelu=False), "fp32", False)
    assert (kept.compile, kept.reward_workers, kept.sigmoid_gelu) == (True, 3, False)
    small = resolve_perf(PerfConfig(preset="gpu_small"), "bf16", False)
    assert (small.compile, small.transitions_per_forward, small.merge_lora) == (True, 0, False)
    none = resolve_perf(PerfConfig(), "fp32", False)
    assert (none.compile, none.sigmoid_gelu, none.reward_workers, none.transitions_per_forward) == (False, False, 1, 1)
    assert set(PRESETS) == {"cpu", "gpu", "gpu_small"}


def test_unknown_preset_is_a_config_error_naming_the_key(tmp_path):
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import load_config

    with pytest.raises(ConfigError, match=r"perf\.preset: unknown 'laptop'; known: none, cpu, gpu, gpu_small"):
        load_config(GRPOConfig, None, [f"run_dir={tmp_path}", "model.pretrained=x", "perf.preset=laptop"])


def test_a_value_equal_to_the_default_still_wins_over_the_preset():
    one = resolve_perf(PerfConfig(preset="cpu", reward_workers=1), "fp32", False)
    assert (one.compile, one.reward_workers) == (True, 1)
    eager = resolve_perf(PerfConfig(preset="gpu", compile=False), "bf16", False)
    assert (eager.compile, eager.sigmoid_gelu) == (False, False)
    per = resolve_perf(PerfConfig(preset="gpu_small", transitions_per_forward=1), "bf16", False)
    assert (per.compile, per.transitions_per_forward) == (True, 1)
    assert resolve_perf(one, "fp32", False) == one  # resolving twice changes nothing


def test_the_preset_override_reaches_the_config_from_the_command_line(tmp_path):
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import load_config

    cfg = load_config(GRPOConfig, None, [f"run_dir={tmp_path}", "model.pretrained=x", "perf.preset=cpu",
                                         "perf.reward_workers=1", "rewards.jpeg_compressibility=1.0"])
    assert resolve_perf(cfg.perf, "fp32", False).reward_workers == 1


def test_a_layout_compile_cannot_run_under_leaves_the_presets_compile_off():
    from pretrain.parallel.config import ParallelConfig

    blocker = ParallelConfig(tp=2).untested_compile()
    assert "parallel.tp=2" in blocker and blocker == ParallelConfig(tp=2).compile_blocker()
    assert ParallelConfig(sp=2).compile_blocker() is None  # compile under SP / CP is not refused, only left to the user
    untested = ParallelConfig(sp=2, cp=2).untested_compile()
    assert untested == "parallel.sp=2, parallel.cp=2: not tested under torch.compile"
    assert ParallelConfig(dp_shard=4).untested_compile() is None
    gpu = resolve_perf(PerfConfig(preset="gpu"), "bf16", True, compile_blocker=blocker)
    assert (gpu.compile, gpu.sigmoid_gelu) == (False, False)
    small = resolve_perf(PerfConfig(preset="gpu_small"), "bf16", True, compile_blocker=blocker)
    assert (small.compile, small.transitions_per_forward) == (False, 0)  # the rest of the preset still holds
    asked = resolve_perf(PerfConfig(preset="gpu", compile=True), "bf16", True, compile_blocker=blocker)
    assert asked.compile  # an explicit value is kept, and refused with a config error where the model is sharded
