"""`torchrun --nproc_per_node 2 -m posttrain grpo CONFIG` end to end on CPU (gloo), as a user launches it:
one job (rank 0 writes one metrics line per iteration, DCP shards from both ranks, one adapter and export),
and a layout that does not divide the prompts stops with a message naming the key."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_machines", "1", "--mixed_precision",
              "no", "--dynamo_backend", "no", "--num_processes", "2"]


def _launch(args: list[str], timeout: int = 300, launcher: list[str] = TORCHRUN) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run([*launcher, "-m", "posttrain", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_torchrun_two_ranks_run_one_grpo_job(tiny_export, tmp_path):
    run = tmp_path / "run"
    proc = _launch(["grpo", "configs/grpo/emoji_tiny.yaml", f"model.pretrained={tiny_export}", f"run_dir={run}",
                    "train.steps=1", "train.threads=1", "eval.grid_prompts=4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run / "grpo"
    assert "ranks: world 2 = dp_replicate 1 x dp_shard 2 x sp 1" in proc.stdout + proc.stderr
    assert proc.stdout.count("export: ") == 1  # printed by rank 0 alone
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # rank 0 alone logs
    # checkpoint folders count iterations, like train.steps (1 iteration = 2 optimizer steps here)
    assert sorted(p.name for p in (out / "checkpoints" / "step_1").glob("*.distcp")) == ["__0_0.distcp",
                                                                                      "__1_0.distcp"]
    assert json.loads((out / "checkpoints" / "step_1" / "shape.json").read_text())[
        "world size (torchrun --nproc_per_node x --nnodes)"] == 2
    lora = load_file(str(out / "lora" / "pytorch_lora_weights.safetensors"))
    assert lora and max(v.abs().max().item() for k, v in lora.items() if "lora_B" in k) > 0  # trained
    assert (out / "export" / "diffusion_pytorch_model.safetensors").is_file()
    assert list((out / "samples").iterdir()) == [out / "samples" / "heldout_iter_00001.png"]
    # resumed by one process (a node lost for good): the shards resharded, iteration 2 trained
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    one = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "configs/grpo/emoji_tiny.yaml",
                          f"model.pretrained={tiny_export}", f"run_dir={run}", "train.steps=2", "train.threads=1",
                          "eval.grid_prompts=4", "--resume"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resuming on 1 process(es) from" in one.stderr and "written by 2" in one.stderr, one.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((out / "checkpoints" / "step_2" / "shape.json").read_text())[
        "world size (torchrun --nproc_per_node x --nnodes)"] == 1


@pytest.mark.long
def test_accelerate_multi_gpu_launch_equals_torchrun_and_cpu_launch_is_refused(tiny_export, tmp_path):
    args = ["grpo", "configs/grpo/emoji_tiny.yaml", f"model.pretrained={tiny_export}", "train.steps=1",
            "train.threads=1", "eval.grid_prompts=4", "checkpoint.every=0"]
    runs = {}
    for name, launcher in (("torchrun", TORCHRUN), ("accelerate", [*ACCELERATE, "--multi_gpu"])):
        proc = _launch([*args, f"run_dir={tmp_path / name}"], launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "ranks: world 2 = dp_replicate 1 x dp_shard 2 x sp 1" in proc.stdout + proc.stderr
        runs[name] = (json.loads((tmp_path / name / "grpo/metrics.jsonl").read_text().splitlines()[0]),
                      load_file(str(tmp_path / name / "grpo/lora/pytorch_lora_weights.safetensors")))
    (m_t, lora_t), (m_a, lora_a) = runs["torchrun"], runs["accelerate"]
    assert m_a["reward_mean"] == m_t["reward_mean"] and m_a["loss"] == m_t["loss"]
    assert lora_a.keys() == lora_t.keys() and all(torch.equal(lora_a[k], lora_t[k]) for k in lora_t)
    # --cpu starts one process whatever --num_processes says: refused before anything loads
    proc = _launch([*args, f"run_dir={tmp_path / 'cpu'}"], launcher=[*ACCELERATE, "--cpu"], timeout=120)
    assert proc.returncode != 0  # the run exits 2 (config error); accelerate reports any failure as 1
    assert "config error: accelerate launch --cpu --num_processes 2 starts one process, not 2: use `accelerate launch " \
           "--multi_gpu --num_processes 2" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cpu/grpo/metrics.jsonl").exists()


@pytest.mark.long  # make test: a config error on every rank in test_config_error_ranks.py
def test_torchrun_prompts_not_divisible_by_ranks_is_a_config_error(tiny_export, tmp_path):
    proc = _launch(["grpo", "configs/grpo/emoji_tiny.yaml", f"model.pretrained={tiny_export}",
                    f"run_dir={tmp_path}", "rollout.prompts_per_step=3", "train.batch_size=6"], timeout=120)
    assert proc.returncode != 0
    assert "rollout.prompts_per_step=3 must be divisible by the 2 data-parallel ranks" in proc.stderr


def test_python_dash_m_posttrain_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "dotted overrides" in proc.stdout
