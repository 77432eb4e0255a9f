"""The GPU benchmark of GRPO at real shapes (`benchmarks/grpo_real_shapes.py`) runs its code path on CPU at
tiny size: torchrun, one gloo rank, the policy FSDP2-sharded (`parallel.always_shard`), LoRA and full
fine-tuning, FLOPs counted per phase. The GPU run differs in device, backend, precision and shapes."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]


def test_grpo_real_shapes_benchmark_runs_sharded_on_one_gloo_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "POSTTRAIN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "benchmarks/grpo_real_shapes.py", "--shape", "tiny", "--device", "cpu", "--backend", "gloo",
           "--precision", "fp32", "--prompts", "2", "--group-size", "2", "--steps", "3", "--iterations", "1",
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "grpo_real_shapes.json").read_text())
    print({m["mode"]: {k: m[k] for k in ("samples_per_s", "time_train_s", "train_tflop", "train_mfu")}
           for m in res["modes"]})
    assert res["backend"] == "gloo" and [m["mode"] for m in res["modes"]] == ["lora", "full"]
    lora, full = res["modes"]
    for m in (lora, full):
        assert m["sharded"] and "world 1" in m["layout"] and m["samples_per_iteration"] == 4
        assert m["time_rollout_s"] > 0 and m["time_train_s"] > 0 and m["peak_memory_mb"] > 0
        # FLOPs counted and timed in the same run: the work can't be done faster than this CPU's matmul rate
        assert 0 < m["train_mfu"] < 1 and 0 < m["rollout_mfu"] < 1
        assert 0 < m["train_tflop"] < m["iteration_tflop"]
    # the same rollout in both modes plus LoRA's adapter matmuls (r 32 on 128-wide projections: measured
    # +10 %; under FSDP no merged copy samples); full fine-tuning adds every Linear's weight gradients
    rollout = {m["mode"]: m["iteration_tflop"] - m["train_tflop"] for m in (lora, full)}
    assert rollout["full"] < rollout["lora"] and full["train_tflop"] > lora["train_tflop"]
    step = res["pretrain_step"]
    assert step["tflops_per_step"] > 0 and 0 < step["mfu"] < 1 and step["losses"][-1] < step["losses"][0]
