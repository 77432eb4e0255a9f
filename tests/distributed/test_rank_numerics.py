"""The numerics guard across ranks: a NaN on one rank only skips the step on every rank (no rank steps
alone), and the replica check names data-parallel replicas whose weights were made to differ."""

import os

import pytest
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from pretrain.parallel.replicas import check_replicas, compare
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import ReplicaDriftError, Runtime
from tests.distributed.common import flow_loss, full_params, tiny_batch, tiny_model

pytestmark = pytest.mark.core


def _step(model, rt, rank, world, step):
    x, sigma, embeds, v = tiny_batch(2 * world, seed=step)
    mine = slice(2 * rank, 2 * rank + 2)
    loss = flow_loss(model, x[mine], sigma[mine], embeds[mine], v[mine])
    rt.backward(loss)
    return rt.optimizer_step(loss.item())


def _nan_on_one_rank(rank, world, tmp):
    model = parallelize(tiny_model(), ParallelDims().build_mesh(), ParallelConfig())
    rt = Runtime(model, RuntimeConfig(steps=4), OptimConfig(lr=1e-2), torch.device("cpu"), f"{tmp}/checkpoints")
    # rank 1's loss value is NaN at step 2 (its gradients are finite); rank 0's gradient is NaN at step 3
    os.environ["POSTTRAIN_FAULT"] = "nan_loss:rank=1,step=2;nan_grad:rank=0,step=3"
    out, params = [], [full_params(model)]
    for step in range(1, 5):
        out.append(_step(model, rt, rank, world, step))
        params.append(full_params(model))
    del os.environ["POSTTRAIN_FAULT"]
    unchanged = [all(torch.equal(params[s][k], params[s - 1][k]) for k in params[s]) for s in range(1, 5)]
    return {"metrics": out, "unchanged": unchanged, "total": rt.guard.total}


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = run_ranks(_nan_on_one_rank, str(tmp_path), world_size=2)
    for r in results:
        m = r["metrics"]
        assert [x["skipped"] for x in m] == [0, 1, 1, 0]
        assert m[1]["nonfinite"] == "loss on rank 1"  # named on both ranks, skipped on both
        assert m[2]["nonfinite"] == "grad_norm on ranks 0, 1"  # the global norm of a NaN shard is NaN everywhere
        assert r["unchanged"] == [False, True, True, False]  # no rank stepped alone
        assert r["total"] == 2 and m[-1]["nonfinite_total"] == 2
    assert results[0]["metrics"][1]["grad_norm"] == results[1]["metrics"][1]["grad_norm"]


def _replicas(rank, world, tmp):
    mesh = ParallelDims(dp_replicate=world, dp_shard=1).build_mesh()
    model = parallelize(tiny_model(), mesh, ParallelConfig())
    clean = check_replicas(model)
    rt = Runtime(model, RuntimeConfig(steps=2, replica_check_every=2), OptimConfig(lr=1e-2), torch.device("cpu"),
                 f"{tmp}/checkpoints")
    _step(model, rt, rank, world, 1)
    if rank == 2:  # one value of one replica changes (as a flipped low mantissa bit would change it)
        w = model.transformer.transformer_blocks[0].attn.to_k.weight._local_tensor
        with torch.no_grad():
            w.view(-1)[3] += 1e-3
    try:
        _step(model, rt, rank, world, 2)
        error = None
    except ReplicaDriftError as e:
        error = str(e)
    return {"clean": clean, "error": error}


def test_the_replica_check_names_the_replica_that_differs(tmp_path):
    results = run_ranks(_replicas, str(tmp_path), world_size=3)
    for r in results:
        assert r["clean"] == []
        assert r["error"] is not None and r["error"].startswith("step 2: data-parallel replicas hold different weights")
        assert "rank 2 (shard [0]) differs from its replicas (ranks [0, 1], the majority) in 1 parameter(s), first " \
               "transformer.transformer_blocks.0.attn.to_k.weight" in r["error"]
        assert "rank 0" not in r["error"] and "rank 1 " not in r["error"]


def test_compare_names_both_replicas_without_a_majority_and_groups_by_shard():
    names = ["a", "b"]
    same, other = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 5]])
    # ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1: shard 1's replicas differ in "b"
    records = [(0, (0,), names, same), (1, (1,), names, same), (2, (0,), names, same), (3, (1,), names, other)]
    out = compare(records)
    assert out == ["rank 1 (shard [1]) differs from its replicas (ranks [3]) in 1 parameter(s), first b",
                   "rank 3 (shard [1]) differs from its replicas (ranks [1]) in 1 parameter(s), first b"]
    assert compare([(0, (), names, same), (1, (), names, same)]) == []
    assert compare([(0, (0,), names, same), (1, (1,), names, other)]) == []  # different shards are not replicas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_change_with_any_single_value(dtype):
    from pretrain.parallel.replicas import param_checksums

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(dtype)
    _, before = param_checksums(model)
    with torch.no_grad():
        w = model.weight.view(-1)
        w[100] = torch.nextafter(w[100], torch.tensor(float("inf"), dtype=dtype))
    _, after = param_checksums(model)
    assert before.dtype == torch.int64 and before.shape == (2, 2)
    assert not torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
