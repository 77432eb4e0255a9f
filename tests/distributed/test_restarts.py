"""`torchrun --max-restarts 1` with a rank that dies (``os._exit`` at an optimizer step, no Python error):
the job restarts without a person, resumes from the last complete checkpoint and ends bitwise where an
uninterrupted run ends (pretraining and GRPO); the run folder says how many restarts happened and why."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pretrain.runtime.guard import NonFiniteError
from pretrain.runtime.restarts import Attempt, ended, restarts_of

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(args: list[str], fault: str | None = None, restarts: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("POSTTRAIN_FAULT", None)
    if fault:
        env["POSTTRAIN_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), "-m", "posttrain", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _metadata(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _check_restart(folder: Path, proc: subprocess.CompletedProcess, resumed: str, seen: tuple[int, ...]):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed (exitcode: 43) local_rank: 1" in proc.stderr  # the injected death, seen by torchrun
    (restart,) = restarts_of(folder)
    assert restart["restart"] == 1 and restart["resumed_from"] == str(folder / "checkpoints" / resumed)
    assert restart["why"][0].startswith("rank 1 (host ")  # the silent death first, then the peer it broke
    # the step a rank was last seen at is written at each checkpoint and at most every 10 s in between
    assert any(restart["why"][0].endswith(f"ended without a Python error: killed, os._exit, a crash or the OOM "
                                          f"killer (last seen at optimizer step {s}, last checkpoint {resumed})")
               for s in seen), restart["why"]
    assert f"torchrun restart 1: resumed from {folder / 'checkpoints' / resumed}" in proc.stderr
    attempts = sorted(p.relative_to(folder / "attempts").parts[1:] for p in (folder / "attempts").rglob("*.json"))
    assert attempts == [("restart_0", "rank_0.json"), ("restart_0", "rank_1.json"), ("restart_1", "rank_0.json"),
                        ("restart_1", "rank_1.json")]
    final = [json.loads(p.read_text()) for p in (folder / "attempts").rglob("restart_1/*.json")]
    assert [r["status"] for r in final] == ["finished", "finished"]


@pytest.mark.long  # an end-to-end torchrun restart; make test keeps the in-process resume and checkpoint tests
def test_pretraining_restarts_after_a_rank_dies_and_ends_bitwise(tmp_path):
    args = ["pretrain", "configs/pretrain/emoji_tiny.yaml", "train.steps=6", "checkpoint.every=2", "eval.every=0",
            "eval.grid_every=0", "train.threads=1", "train.batch_size=16"]
    plain = _torchrun([*args, f"run_dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    died = _torchrun([*args, f"run_dir={tmp_path / 'died'}"], fault="exit:rank=1,step=5", restarts=1)
    folder = tmp_path / "died" / "pretrain"
    _check_restart(folder, died, "step_4", (4,))
    weights = "export/diffusion_pytorch_model.safetensors"
    assert _same(load_file(str(folder / weights)), load_file(str(tmp_path / "plain/pretrain" / weights)))
    # one record per step, steps 5-6 from the restarted attempt, equal to the uninterrupted run's
    losses = [(r["step"], r["loss"]) for r in _metrics(folder) if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in _metrics(tmp_path / "plain/pretrain") if "loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]


@pytest.mark.long  # as the pretraining restart
def test_grpo_restarts_after_a_rank_dies_and_ends_bitwise(tiny_export, tmp_path):
    args = ["grpo", "configs/grpo/emoji_tiny.yaml", f"model.pretrained={tiny_export}", "train.steps=3",
            "checkpoint.every=1", "train.threads=1", "eval.grid_prompts=4"]
    plain = _torchrun([*args, f"run_dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    # 2 optimizer steps per iteration: rank 1 dies in iteration 2's second step, after checkpoint step_1
    died = _torchrun([*args, f"run_dir={tmp_path / 'died'}"], fault="exit:rank=1,step=4", restarts=1)
    folder = tmp_path / "died" / "grpo"
    _check_restart(folder, died, "step_1", (2, 3))
    lora = "lora/pytorch_lora_weights.safetensors"
    assert _same(load_file(str(folder / lora)), load_file(str(tmp_path / "plain/grpo" / lora)))
    # the adapter config too (the header's key order is safetensors', which varies between processes)
    assert _metadata(folder / lora) == _metadata(tmp_path / "plain/grpo" / lora)
    rewards = [(r["step"], r["reward_mean"]) for r in _metrics(folder)]
    assert rewards == [(r["step"], r["reward_mean"]) for r in _metrics(tmp_path / "plain/grpo")]


def test_a_restart_after_a_deliberate_stop_does_not_train_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = Attempt(tmp_path, rank=0)
    first.begin(0, None)
    first.end(NonFiniteError("step 3: non-finite loss for 4 steps in a row"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Attempt(tmp_path, rank=0).previous_stop() == "rank 0: NonFiniteError: step 3: non-finite loss for 4 " \
                                                        "steps in a row"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert not Attempt(tmp_path / "other", rank=0).enabled  # outside torchrun nothing is recorded


def test_ended_says_how_a_rank_ended():
    base = {"rank": 3, "host": "node7", "pid": 11, "step": 40, "checkpoint": 30}
    assert ended({**base, "status": "running"}) == ("rank 3 (host node7, pid 11) ended without a Python error: killed, "
                                                   "os._exit, a crash or the OOM killer (last seen at optimizer step "
                                                   "40, last checkpoint step_30)")
    assert ended({**base, "status": "terminated", "checkpoint": None}) == (
        "rank 3 (host node7, pid 11) was stopped by torchrun (SIGTERM) after another rank failed (last seen at "
        "optimizer step 40, no checkpoint yet)")
    assert ended({**base, "status": "failed", "error": "OSError: disk full"}).endswith(
        "failed (last seen at optimizer step 40, last checkpoint step_30): OSError: disk full")
