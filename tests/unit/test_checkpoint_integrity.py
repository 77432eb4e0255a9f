"""Checkpoints carry a manifest; a corrupt or non-finite checkpoint is reported by path and the previous
intact one is used; weights that are not finite are never checkpointed; each resume keeps its config."""

import errno
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from pretrain.runtime.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.config_record import record_config
from pretrain.runtime.guard import NonFiniteError
from pretrain.runtime.runtime import Runtime
from pretrain.runtime.storage import StorageError

pytestmark = pytest.mark.core


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


def test_non_finite_optimizer_or_schedule_state_is_never_saved_nor_resumed(tmp_path, caplog):
    rt = _runtime(tmp_path)
    _step(rt)
    rt.save()
    _step(rt)
    state = rt.state_dict()
    moment = state["optim"]["state"]["weight"]["exp_avg"]
    state["optim"]["state"]["weight"]["exp_avg"] = torch.full_like(moment, float("nan"))
    rt.checkpoints.save(2, state, rt.shape)  # written around Runtime.save's check, as a foreign tool might
    fresh = _runtime(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING):
        assert fresh.resume() == tmp_path / "step_1" and fresh.step == 1
    assert "step_2 is not usable: optimizer state exp_avg of parameter weight holds non-finite values" in caplog.text
    # and a save refuses the same state, as it refuses non-finite weights
    other = _runtime(tmp_path / "other")
    _step(other)
    with torch.no_grad():
        other.optimizer.state[other.model.bias]["exp_avg_sq"][0] = float("inf")
    with caplog.at_level(logging.WARNING):
        assert other.save() is None
    assert "checkpoint step_1 not written: optimizer state exp_avg_sq of parameter bias holds non-finite values; " \
           "the latest checkpoint stays None" in caplog.text
    assert other.checkpoints.steps() == []
    fresh.scheduler.base_lrs[0] = float("nan")
    assert fresh.unhealthy() == "LR schedule state base_lrs.0 is not finite"


def _nan_steps(rt, n):
    for _ in range(n):
        _step(rt, lambda y: y.sum() * float("nan"))


def test_the_stop_names_the_checkpoint_and_counts_in_the_run_s_unit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    rt = Runtime(model, RuntimeConfig(steps=10, max_nonfinite=1), OptimConfig(lr=0.1), torch.device("cpu"), tmp_path,
                 unit=("iteration", 2))
    _step(rt)
    _step(rt)
    rt.save(1)  # checkpoints are named by iteration
    _nan_steps(rt, 1)
    with pytest.raises(NonFiniteError) as stop:
        _nan_steps(rt, 1)
    assert str(stop.value) == (
        "iteration 2 (optimizer step 4): non-finite loss for 2 optimizer steps in a row (train.max_nonfinite=1); "
        f"stopping. No weights were updated on those steps; --resume continues from {tmp_path / 'step_1'}, the "
        "newest checkpoint (written from finite weights and optimizer state, and checked again on resume)")
    plain = _runtime(tmp_path / "none")
    plain.guard.max_consecutive = 0
    with pytest.raises(NonFiniteError, match=r"^step 1: non-finite loss for 1 steps in a row .*no checkpoint was "
                                             r"written yet, so there is nothing to resume"):
        _nan_steps(plain, 1)
    assert "intact" not in str(stop.value)


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_checkpointing_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    rt = _runtime(tmp_path)
    _step(rt)
    first = rt.save()
    _step(rt)
    monkeypatch.setattr(FileSystemWriter, "write_data", _full_disk)
    with pytest.raises(StorageError) as err:
        rt.save()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {tmp_path / 'step_2'} not written: No space left on device (")
    assert f" free in {tmp_path}); nothing was lost: the partial .tmp_step_2 was removed, never renamed, and the " \
           f"newest checkpoint stays {first}" in msg
    assert rt.checkpoints.steps() == [1] and not (tmp_path / ".tmp_step_2").exists()
    assert CheckpointManager.verify(first) is None


def test_a_refused_write_of_an_export_is_one_line_and_keeps_the_previous_export(tmp_path):
    from pretrain.codec import CodecConfig
    from pretrain.export import ExportMeta, export_model
    from pretrain.text_encoder import TextEncoderConfig

    class Denied(torch.nn.Module):
        def save_pretrained(self, folder, **kwargs):
            Path(folder).mkdir(parents=True)
            (Path(folder) / "part.safetensors").write_bytes(b"partial")
            raise PermissionError(errno.EACCES, "Permission denied", str(folder))

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "old.txt").write_text("the previous export")
    with pytest.raises(StorageError, match=rf"^export {tmp_path / 'export'} not written: Permission denied \(.* free "
                                           rf"in {tmp_path}\); nothing was lost: the partial .tmp_export was removed"):
        export_model(Denied(), tmp_path / "export", ExportMeta(TextEncoderConfig(), CodecConfig(), 16, {}))
    assert (tmp_path / "export" / "old.txt").read_text() == "the previous export"
    assert not (tmp_path / ".tmp_export").exists()
