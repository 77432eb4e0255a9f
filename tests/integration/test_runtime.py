"""Shared runtime guarantees on the tiny pretraining run: exact resume, crash-safe checkpoints,
the non-finite guard, and mixed precision."""

import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from posttrain.cli import main
from pretrain import objective
from pretrain.runtime.checkpoint import CheckpointManager
from pretrain.runtime.metrics import read_metrics
from pretrain.runtime.runtime import Runtime
from pretrain import trainer as trainer_mod
from pretrain.trainer import train
from tests.conftest import ROOT, tiny_config

pytestmark = pytest.mark.core

RESUME_ARGS = ("train.steps=4", "train.grad_accum=2", "train.batch_size=8", "train.ema_decay=0.9",
               "optim.schedule=cosine", "optim.warmup_steps=1", "checkpoint.every=2", "checkpoint.keep_last=5",
               "eval.every=0")


class _Stop(Exception):
    pass


def _load_ckpt(path, tmp):
    out = tmp / f"{path.parent.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def test_resume_is_bitwise_identical(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(tiny_config(straight, *RESUME_ARGS))

    interrupted = tmp_path / "interrupted"
    orig_save = Runtime.save

    def save_then_die(self):
        path = orig_save(self)
        if self.step == 2:
            raise _Stop
        return path

    monkeypatch.setattr(Runtime, "save", save_then_die)
    with pytest.raises(_Stop):
        train(tiny_config(interrupted, *RESUME_ARGS))
    monkeypatch.setattr(Runtime, "save", orig_save)
    train(tiny_config(interrupted, *RESUME_ARGS, "checkpoint.resume=true"))

    a = _load_ckpt(straight / "pretrain/checkpoints/step_4", tmp_path)
    b = _load_ckpt(interrupted / "pretrain/checkpoints/step_4", tmp_path)
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys() and len(a[part]) > 10
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    assert a["stateful"]["sampler"] == b["stateful"]["sampler"]  # next batch is the same data
    assert a["step"] == b["step"] == 4
    # EMA really differs from the raw weights (it is on)
    shared = [k for k in a["model"] if "module." + k in a["ema"]]  # the trainable parameters (no buffers)
    assert len(shared) == len(a["ema"]) - 1  # and n_averaged
    assert any(not torch.equal(a["model"][k], a["ema"]["module." + k]) for k in shared)
    la = [(r["step"], r["loss"]) for r in read_metrics(straight / "pretrain/metrics.jsonl") if "loss" in r]
    lb = [(r["step"], r["loss"]) for r in read_metrics(interrupted / "pretrain/metrics.jsonl") if "loss" in r]
    assert la == lb and [s for s, _ in la] == [1, 2, 3, 4]
    ea = (straight / "pretrain/export/diffusion_pytorch_model.safetensors").read_bytes()
    eb = (interrupted / "pretrain/export/diffusion_pytorch_model.safetensors").read_bytes()
    assert ea == eb


KILLER = r"""
import os, signal, sys
import torch.distributed.checkpoint.filesystem as fs
orig = fs.FileSystemWriter.write_data
calls = []
def write_data(self, plan, planner):
    calls.append(1)
    fut = orig(self, plan, planner)
    if len(calls) == 2:  # the second checkpoint: data files written, metadata not yet
        fut.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return fut
fs.FileSystemWriter.write_data = write_data
from posttrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_while_writing_a_checkpoint_resumes_from_previous(tmp_path):
    args = [str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={tmp_path}", "train.steps=6",
            "checkpoint.every=2", "eval.every=0"]
    proc = subprocess.run([sys.executable, "-c", KILLER, "pretrain", *args], capture_output=True, text=True,
                          env={**os.environ}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = tmp_path / "pretrain/checkpoints"
    assert (ckpts / "step_2").is_dir() and not (ckpts / "step_4").exists()
    assert (ckpts / ".tmp_step_4").is_dir()  # the interrupted write
    assert CheckpointManager(ckpts).latest() == ckpts / "step_2"
    state = _load_ckpt(ckpts / "step_2", tmp_path)
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in state["model"].values())
    assert main(["pretrain", *args, "--resume"]) == 0
    assert CheckpointManager(ckpts).steps() == [4, 6]
    assert not (ckpts / ".tmp_step_4").exists()
    steps = [r["step"] for r in read_metrics(tmp_path / "pretrain/metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def _nan_at(monkeypatch, bad_steps):
    """Make the training loss NaN on the given 0-based optimizer steps."""
    orig = objective.pretrain_loss
    state = {"step": 0}

    def loss(model, *a, **k):
        value = orig(model, *a, **k)
        return value * float("nan") if model.training and state["step"] in bad_steps else value

    orig_step = Runtime.optimizer_step
    snapshots = []

    def step(self, loss_value, buckets=None):
        before = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out = orig_step(self, loss_value, buckets)
        snapshots.append((before, {k: v.detach().clone() for k, v in self.model.state_dict().items()}))
        state["step"] += 1
        return out

    monkeypatch.setattr(objective, "pretrain_loss", loss)
    monkeypatch.setattr(trainer_mod, "pretrain_loss", loss)
    monkeypatch.setattr(Runtime, "optimizer_step", step)
    return snapshots


def test_nan_loss_skips_the_step_and_training_continues(tmp_path, monkeypatch):
    snaps = _nan_at(monkeypatch, {2})
    train(tiny_config(tmp_path, "train.steps=5", "eval.every=0"))
    before, after = snaps[2]
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights of step 2 untouched
    for i in (1, 3):  # neighbouring steps do update
        b, a = snaps[i]
        assert any(not torch.equal(b[k], a[k]) for k in b)
    recs = {r["step"]: r for r in read_metrics(tmp_path / "pretrain/metrics.jsonl") if "loss" in r}
    assert recs[3]["nonfinite"] == "loss" and recs[3]["skipped"] == 1 and recs[3]["loss"] == "nan"
    assert recs[5]["nonfinite_total"] == 1 and recs[5]["skipped"] == 0
    assert math.isfinite(recs[5]["loss"])


def test_consecutive_nans_stop_the_run_with_last_checkpoint_intact(tmp_path, monkeypatch, capsys, caplog):
    _nan_at(monkeypatch, set(range(2, 100)))
    code = main(["pretrain", str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={tmp_path}",
                 "train.steps=10", "train.max_nonfinite=2", "checkpoint.every=2", "eval.every=0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "non-finite loss" in err and "3 steps in a row" in err and "intact" not in err
    assert f"--resume continues from {tmp_path / 'pretrain/checkpoints/step_2'}, the newest checkpoint" in err
    assert "checkpoint step_4 not written: the last 2 step(s) were non-finite and skipped" in caplog.text
    ckpts = CheckpointManager(tmp_path / "pretrain/checkpoints")
    assert ckpts.steps() == [2]  # steps 3 and 4 were skipped, so step 4's weights were not saved; 5 stopped the run
    good = _load_ckpt(ckpts.root / "step_2", tmp_path)
    assert all(torch.isfinite(v).all() for v in good["model"].values())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains(tmp_path, precision):
    train(tiny_config(tmp_path, f"train.precision={precision}", "train.steps=30", "eval.every=30"))
    held = [r["heldout_loss"] for r in read_metrics(tmp_path / "pretrain/metrics.jsonl") if "heldout_loss" in r]
    assert held[-1] < 0.85 * held[0], held


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    args = ["pretrain", str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={tmp_path}", "train.steps=2",
            "checkpoint.every=1", "eval.every=0"]
    assert main(args) == 0
    assert main(args[:-3] + ["train.steps=3", "checkpoint.every=1", "eval.every=0"]) == 1
    assert "--resume" in capsys.readouterr().err
    assert CheckpointManager(tmp_path / "pretrain/checkpoints").steps() == [1, 2]  # nothing pruned


def test_torn_metrics_line_does_not_break_resume(tmp_path):
    args = ["pretrain", str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={tmp_path}", "train.steps=2",
            "checkpoint.every=1", "eval.every=0"]
    assert main(args) == 0
    metrics = tmp_path / "pretrain/metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 0.')  # killed mid-write
    assert main(args[:4] + ["train.steps=3", "checkpoint.every=1", "eval.every=0", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(metrics)]
    assert steps == [0, 1, 2, 3]


def test_wandb_offline_mirrors_metrics_and_a_resume_continues_the_run(tmp_path):
    args = ("eval.every=0", "wandb.mode=offline", "wandb.name=tiny", "checkpoint.every=1")
    train(tiny_config(tmp_path, "train.steps=2", *args))
    runs = list((tmp_path / "pretrain/wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    run_id = (tmp_path / "pretrain/wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(f"-{run_id}")
    train(tiny_config(tmp_path, "train.steps=3", *args, "checkpoint.resume=true"))
    ids = {p.name.rsplit("-", 1)[1] for p in (tmp_path / "pretrain/wandb").glob("offline-run-*")}
    assert ids == {run_id}  # the resumed start logs under the same wandb run id


def test_a_refused_resume_writes_no_config_and_resume_auto_starts_fresh(tmp_path, capsys):
    args = ["pretrain", str(ROOT / "configs/pretrain/emoji_tiny.yaml"), f"run_dir={tmp_path}", "train.steps=1",
            "checkpoint.every=1", "eval.every=0"]
    assert main([*args, "--resume=auto"]) == 0  # nothing to resume: a new run, said so
    assert "--resume=auto: no checkpoint in" in capsys.readouterr().err
    run = tmp_path / "pretrain"
    assert main([*args, "optim.lr=0.5", "--resume"]) == 2  # the checkpoint's shape refuses another lr
    assert "optim.lr: the checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]
