"""Checkpoints carry a manifest; a corrupt or non-finite checkpoint is reported by path and the previous
intact one is used; weights that are not finite are never checkpointed; each resume keeps its config."""

import json
import logging
from dataclasses import dataclass, field

import pytest
import torch

from pretrain.runtime.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.config_record import record_config
from pretrain.runtime.runtime import Runtime


def _runtime(root, lr=0.1, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return Runtime(model, RuntimeConfig(steps=10), OptimConfig(lr=lr), torch.device("cpu"), root, keep_last=5)


def _step(rt, loss_fn=lambda y: (y ** 2).mean()):
    loss = loss_fn(rt.model(torch.ones(2, 4)))
    rt.backward(loss)
    return rt.optimizer_step(float(loss.detach()))


def _weights(rt):
    return {k: v.detach().clone() for k, v in rt.model.state_dict().items()}


def _shard(path):
    return next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")


def test_manifest_lists_every_file_and_verify_finds_a_changed_byte(tmp_path):
    rt = _runtime(tmp_path)
    _step(rt)
    path = rt.save()
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert set(files) == {p.name for p in path.iterdir() if p.name != MANIFEST} and ".metadata" in files
    assert CheckpointManager.verify(path) is None
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert CheckpointManager.verify(path) == f"{shard.name} does not match its SHA-256 in {MANIFEST}"
    shard.write_bytes(bytes(data[:-3]))
    assert "bytes, the manifest says" in CheckpointManager.verify(path)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    rt = _runtime(tmp_path)
    _step(rt)
    rt.save()
    after_one = _weights(rt)
    _step(rt)
    latest = rt.save()
    shard = _shard(latest)  # 3e38 planted over 16 float32 values: finite, loadable, wrong
    data = bytearray(shard.read_bytes())
    data[-64:] = torch.full((16,), 3e38).numpy().tobytes()
    shard.write_bytes(bytes(data))
    fresh = _runtime(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING):
        resumed = fresh.resume()
    assert resumed == tmp_path / "step_1" and fresh.step == 1
    assert all(torch.equal(after_one[k], v) for k, v in _weights(fresh).items())
    assert f"checkpoint {latest} is not usable: {shard.name} does not match its SHA-256" in caplog.text
    # and when no checkpoint is intact, the run stops naming each one
    shard1 = _shard(tmp_path / "step_1")
    shard1.write_bytes(shard1.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step_2: .*; .*step_1: .*bytes"):
        _runtime(tmp_path, seed=2).resume()


def test_a_checkpoint_holding_non_finite_weights_is_skipped(tmp_path, caplog):
    rt = _runtime(tmp_path)
    _step(rt)
    rt.save()
    _step(rt)
    state = rt.state_dict()
    state["model"]["weight"] = torch.full_like(state["model"]["weight"], float("nan"))
    rt.checkpoints.save(2, state, rt.shape)  # written around Runtime.save's check, as a foreign tool might
    fresh = _runtime(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING):
        assert fresh.resume() == tmp_path / "step_1"
    assert "step_2 is not usable: parameter weight holds non-finite values" in caplog.text


def test_weights_are_not_checkpointed_after_a_step_that_blew_them_up(tmp_path, caplog):
    rt = _runtime(tmp_path, lr=1e10)
    assert rt.save(0) is not None
    explode = lambda y: y.pow(4).sum()  # noqa: E731
    assert _step(rt, explode)["skipped"] == 0  # finite loss and gradient: the step is taken, weights ~1e10
    assert rt.model.weight.abs().max() > 1e9
    assert _step(rt, explode)["skipped"] == 1  # (4e10)^4 overflows float32: skipped
    with caplog.at_level(logging.WARNING):
        assert rt.save() is None
    assert "checkpoint step_2 not written: the last 1 step(s) were non-finite and skipped" in caplog.text
    assert rt.checkpoints.steps() == [0]
    with torch.no_grad():
        rt.model.bias[0] = float("inf")
    rt.guard.consecutive = 0
    assert rt.unhealthy() == "parameter bias holds non-finite values"


@dataclass
class _Cfg:
    lr: float = 0.1
    steps: int = 2
    checkpoint: dict = field(default_factory=lambda: {"resume": False})


def test_each_resume_keeps_its_config_and_logs_what_changed(tmp_path, caplog):
    assert record_config(_Cfg(), tmp_path, resume=False) == tmp_path / "config.yaml"
    (tmp_path / "checkpoints/step_2").mkdir(parents=True)
    assert record_config(_Cfg(lr=0.5), tmp_path, resume=False) is None  # refused later: the config is kept
    with caplog.at_level(logging.WARNING):
        first = record_config(_Cfg(lr=0.2, steps=4, checkpoint={"resume": True}), tmp_path, resume=True)
        second = record_config(_Cfg(lr=0.2, steps=6, checkpoint={"resume": True}), tmp_path, resume=True)
    assert (first.name, second.name) == ("config.resume-1.yaml", "config.resume-2.yaml")
    assert "lr: 0.1\n" in (tmp_path / "config.yaml").read_text() and "steps: 6" in second.read_text()
    assert "since config.yaml (this start's config: config.resume-1.yaml): lr: 0.1 -> 0.2; steps: 2 -> 4" in caplog.text
    assert "since config.resume-1.yaml (this start's config: config.resume-2.yaml): steps: 4 -> 6" in caplog.text
