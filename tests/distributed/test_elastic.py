"""An elastic job loses a node for good and goes on without it: 3 torchrun agents (one rank each, as
3 nodes would run) join one rendezvous with ``--nnodes 2:3 --max-restarts 1``; at optimizer step 3 the
rank 2 kills its agent and exits (``POSTTRAIN_FAULT=node:...``). The 2 agents left restart their ranks
as a world of 2, which resume from the last checkpoint, written by 3 ranks (step 2), and finish the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.parallel.launch import free_port
from pretrain.runtime.restarts import restarts_of

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]


def test_an_elastic_job_goes_on_with_two_of_three_nodes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "POSTTRAIN_FAULT": "node:rank=2,step=3"}
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic",
           "--rdzv_conf", "last_call_timeout=5", "--max-restarts", "1", "-m", "posttrain", "pretrain",
           "configs/pretrain/emoji_tiny.yaml", f"run_dir={run}", "train.steps=4", "train.batch_size=12",
           "train.threads=1", "checkpoint.every=2", "eval.every=0", "eval.grid_every=0"]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    outs = [a.communicate(timeout=600) for a in agents]
    codes = sorted(a.returncode for a in agents)
    logs = "\n".join(err[-3000:] for _, err in outs)
    assert codes.count(0) == 2 and -9 in codes, (codes, logs)  # two nodes finish; the killed agent: SIGKILL
    folder = run / "pretrain"
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4
    shapes = {s: json.loads((folder / "checkpoints" / f"step_{s}" / "shape.json").read_text())[
        "world size (torchrun --nproc_per_node x --nnodes)"] for s in (2, 4)}
    assert shapes == {2: 3, 4: 2}  # written by 3 ranks, then by the 2 left
    (restart,) = restarts_of(folder)
    assert restart["resumed_from"] == str(folder / "checkpoints" / "step_2")
    assert "resuming on 2 process(es) from" in logs and "written by 3" in logs
