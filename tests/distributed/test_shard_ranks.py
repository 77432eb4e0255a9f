"""Pretraining from tar shards on 2 gloo ranks sees the global sample stream of one process: the same
sample keys in every step (each rank reading its share through its own DataLoader workers) and the
same losses."""

import hashlib

import pytest

from pretrain.parallel.launch import run_ranks
from tests.conftest import tiny_config
from tests.shard_sets import record_keys, tar_set

pytestmark = pytest.mark.core


def _pretrain(rank, world, run_dir, folder):
    from pretrain.runtime.loop import run_stage
    from pretrain.runtime.metrics import read_metrics
    from pretrain.trainer import PretrainRun

    run = PretrainRun(tiny_config(run_dir, "data.source=shards", f"data.path={folder}", "data.workers=1",
                                  "data.shuffle_buffer=64", "train.steps=3", "train.grad_accum=2", "train.threads=1",
                                  "eval.every=0", "eval.heldout_samples=8", "optim.eps=1e-4"))
    keys = record_keys(run)
    run_stage(run)
    losses = [r["loss"] for r in read_metrics(run.run / "metrics.jsonl") if "loss" in r] if rank == 0 else []
    return {"keys": keys, "losses": losses}


def _digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:12]


def test_two_ranks_read_the_global_stream_of_one_process(tmp_path, capsys):
    tar_set(tmp_path / "shards", n=1000, per_shard=50)
    one = run_ranks(_pretrain, str(tmp_path / "one"), str(tmp_path / "shards"), world_size=1)[0]
    two = run_ranks(_pretrain, str(tmp_path / "two"), str(tmp_path / "shards"), world_size=2)
    # every micro-batch: rank 0's share then rank 1's is the one process's micro-batch
    merged = [a + b for a, b in zip(two[0]["keys"], two[1]["keys"])]
    assert len(one["keys"]) == 6 and [len(k) for k in two[0]["keys"]] == [8] * 6
    per_step = [_digest(sum(one["keys"][i:i + 2], [])) for i in range(0, 6, 2)]
    with capsys.disabled():
        print(f"\nshards, sample-key hash per step: 1 process {per_step}, 2 ranks "
              f"{[_digest(sum(merged[i:i + 2], [])) for i in range(0, 6, 2)]}; losses {one['losses']} vs "
              f"{two[0]['losses']}")
    assert merged == one["keys"]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one["losses"], two[0]["losses"]))
