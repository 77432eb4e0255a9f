"""The loss-spike detector (z-score per name, per sigma bucket), fault injection's spec and the NCCL
flight-recorder defaults, on made-up numbers; a spike skips the optimizer step with spike_action=skip."""

import math

import pytest
import torch

from pretrain.parallel.launch import flight_recorder_env
from pretrain.runtime import faults
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import Runtime
from pretrain.runtime.spikes import SpikeDetector, sigma_buckets

pytestmark = pytest.mark.core


def test_a_spike_is_flagged_with_its_z_score_and_joins_the_history():
    det = SpikeDetector(window=10, zscore=6.0, min_history=4)
    for v in (1.0, 1.1, 0.9, 1.0):  # mean 1.0, population std sqrt(0.005)
        assert det.check({"loss": v}) == []
    (name, value, z), = det.check({"loss": 2.0})
    assert (name, value) == ("loss", 2.0) and z == pytest.approx(1.0 / math.sqrt(0.005))
    assert det.check({"loss": 1.0}) == []  # below the mean: never a spike
    assert list(det.history["loss"]) == [1.0, 1.1, 0.9, 1.0, 2.0, 1.0]


def test_too_little_history_nan_and_window_zero_flag_nothing():
    det = SpikeDetector(window=10, zscore=1.0, min_history=3)
    assert det.check({"loss": 1.0}) == det.check({"loss": 1e9}) == []  # fewer than 3 values seen
    assert det.check({"loss": float("nan")}) == [] and len(det.history["loss"]) == 2
    off = SpikeDetector(window=0)
    assert not off.enabled and off.check({"loss": 1e9}) == [] and off.history == {}


def test_state_dict_round_trip_judges_as_the_original():
    a, b = SpikeDetector(window=5, zscore=3.0, min_history=3), SpikeDetector(window=5, zscore=3.0, min_history=3)
    for v in (1.0, 2.0, 1.5, 1.2, 1.8, 1.4):
        a.check({"x": v})
    b.load_state_dict(a.state_dict())
    assert list(b.history["x"]) == [2.0, 1.5, 1.2, 1.8, 1.4]  # the window keeps the last 5
    assert a.check({"x": 9.0}) == b.check({"x": 9.0}) != []


def test_sigma_buckets_sum_losses_by_sigma_with_one_in_the_last_bucket():
    sigma = torch.tensor([0.0, 0.1, 0.25, 0.6, 0.75, 1.0])
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert sigma_buckets(sigma, losses) == {"loss/sigma_0.00-0.25": (3.0, 2), "loss/sigma_0.25-0.50": (3.0, 1),
                                            "loss/sigma_0.50-0.75": (4.0, 1), "loss/sigma_0.75-1.00": (11.0, 2)}


def test_spike_action_skip_leaves_the_weights_alone_and_counts_the_spike(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    rt = Runtime(model, RuntimeConfig(steps=30, spike_window=10, spike_action="skip"), OptimConfig(lr=0.01),
                 torch.device("cpu"), tmp_path, keep_last=1)
    for i in range(12):  # min_history = 5 for a window of 10
        rt.backward(model(torch.ones(1, 4)).pow(2).mean())
        out = rt.optimizer_step(1.0 + 0.01 * (i % 3))
        assert out["spike"] == out["skipped"] == 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rt.backward(model(torch.ones(1, 4)).pow(2).mean())
    out = rt.optimizer_step(50.0)
    assert (out["spike"], out["skipped"], out["spikes_total"], rt.step) == (1, 1, 1, 13)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fault_spec_reads_each_kind_and_names_the_variable_when_it_cannot(monkeypatch):
    spec = "exit:rank=1,step=5; nan_loss:rank=0,step=2,restart=1"
    assert faults.parse(spec) == [faults.Fault("exit", 1, 5, 0), faults.Fault("nan_loss", 0, 2, 1)]
    for bad in ("exit:rank=1", "boom:rank=1,step=2", "exit:rank=x,step=2", "exit:rank=1,step=2,when=3"):
        with pytest.raises(ValueError, match="POSTTRAIN_FAULT: cannot read"):
            faults.parse(bad)
    monkeypatch.setenv("POSTTRAIN_FAULT", spec)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.active(2) == {"nan_loss"} and faults.active(5) == set()
    assert math.isnan(faults.inject(2, 1.0, []))


def test_flight_recorder_defaults_leave_what_the_user_set(tmp_path):
    env = flight_recorder_env(tmp_path / "fr", {})
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_")}
    mine = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/trace_"}
    assert flight_recorder_env(tmp_path, mine) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"})


def test_a_checkpoint_written_before_the_spike_detector_resumes(tmp_path, monkeypatch):
    def runtime():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return Runtime(model, RuntimeConfig(steps=5, spike_window=10), OptimConfig(lr=0.01), torch.device("cpu"),
                       tmp_path, keep_last=2)

    old = runtime()
    for _ in range(2):
        old.backward(old.model(torch.ones(1, 4)).pow(2).mean())
        old.optimizer_step(1.0)
    full = Runtime.state_dict
    monkeypatch.setattr(Runtime, "state_dict", lambda self: {k: v for k, v in full(self).items() if k != "spikes"})
    path = old.save()
    monkeypatch.undo()
    assert not old.checkpoints.holds(path, "spikes") and old.checkpoints.holds(path, "step")
    new = runtime()
    assert new.start(resume=True) == path
    assert new.step == 2 and new.spikes.history == {} and new.spikes_total == 0
    assert all(torch.equal(a, b) for a, b in zip(old.model.state_dict().values(), new.model.state_dict().values()))
