"""FSDP2 on 2 ranks equals one process on the combined batch; HSDP replicas stay identical.

One pair of processes (started once for the module: each imports diffusers) runs every scenario."""

import pytest
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from tests.distributed.common import flow_loss, full_grads, full_params, tiny_batch, tiny_model
from pretrain.parallel.launch import run_ranks

pytestmark = pytest.mark.core

MICRO = 2  # samples per rank per micro-batch


def _compare(a: dict, b: dict) -> tuple[float, float]:
    """(max abs difference, max abs value of b) over the common keys; asserts equal key sets."""
    assert set(a) == set(b)
    return (max(float((a[k] - b[k]).abs().max()) for k in b), max(float(b[k].abs().max()) for k in b))


def _fsdp_vs_single(rank, world, accum, sync_every_micro, checkpointing=False):
    torch.manual_seed(0)
    mesh = ParallelDims().build_mesh()
    ref, model = tiny_model(), parallelize(tiny_model(), mesh, ParallelConfig(activation_checkpointing=checkpointing))
    calls = []
    model.transformer.transformer_blocks[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))
    x, sigma, embeds, v = tiny_batch(MICRO * world * accum)
    for m in range(accum):
        if not sync_every_micro:  # skip the reduce-scatter until the last micro-batch
            model.set_requires_gradient_sync(m == accum - 1)
        combined = slice(m * MICRO * world, (m + 1) * MICRO * world)
        mine = slice(combined.start + rank * MICRO, combined.start + (rank + 1) * MICRO)
        (flow_loss(model, x[mine], sigma[mine], embeds[mine], v[mine]) / accum).backward()
        (flow_loss(ref, x[combined], sigma[combined], embeds[combined], v[combined]) / accum).backward()
    grad_diff, grad_max = _compare(full_grads(model), full_grads(ref))
    before = full_params(ref)
    for net in (model, ref):
        torch.optim.SGD(net.parameters(), lr=0.5).step()
    param_diff, _ = _compare(full_params(model), full_params(ref))
    moved = max(float((p - before[k]).abs().max()) for k, p in full_params(ref).items())
    return dict(grad_diff=grad_diff, grad_max=grad_max, param_diff=param_diff, moved=moved,
                attn_calls_per_micro=len(calls) / accum)


def _check(results):
    for r in results:
        assert r["grad_max"] > 1e-3 and r["moved"] > 1e-4  # real gradients, a real step
        assert r["grad_diff"] <= 1e-5 * r["grad_max"], r
        assert r["param_diff"] <= 1e-6, r
    print(results[0])


def _hsdp_adamw(rank, world):
    mesh = ParallelDims(dp_replicate=2, dp_shard=1).build_mesh()
    model = parallelize(tiny_model(), mesh, ParallelConfig())
    before = full_params(model)
    x, sigma, embeds, v = tiny_batch(2 * world)
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)  # different samples on each replica
    flow_loss(model, x[mine], sigma[mine], embeds[mine], v[mine]).backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    after = full_params(model)
    local = {k: p.to_local() for k, p in model.named_parameters()}
    return dict(after=after, local=local, moved=max(float((after[k] - before[k]).abs().max()) for k in after))


def _scenarios(rank, world):
    return dict(one=_fsdp_vs_single(rank, world, 1, True), accum=_fsdp_vs_single(rank, world, 2, False),
                checkpointing=_fsdp_vs_single(rank, world, 1, True, checkpointing=True), hsdp=_hsdp_adamw(rank, world))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios)


def test_fsdp_step_equals_single_process_on_combined_batch(results):
    _check([r["one"] for r in results])


def test_fsdp_gradient_accumulation_equals_single_process(results):
    _check([r["accum"] for r in results])


def test_fsdp_with_activation_checkpointing_equals_single_process(results):
    _check([r["checkpointing"] for r in results])
    assert [r["checkpointing"]["attn_calls_per_micro"] for r in results] == [2, 2]  # forward + recompute
    assert [r["one"]["attn_calls_per_micro"] for r in results] == [1, 1]


def test_hsdp_replicas_identical_after_adamw(results):
    r0, r1 = (r["hsdp"] for r in results)
    assert r0["moved"] > 5e-3  # AdamW's first step moves each weight by about lr
    assert set(r0["after"]) == set(r1["after"])
    for k in r0["after"]:
        assert r0["local"][k].shape == r0["after"][k].shape  # dp_shard 1: each replica holds everything
        assert torch.equal(r0["local"][k], r1["local"][k]), k
