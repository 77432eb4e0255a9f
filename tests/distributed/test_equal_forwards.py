"""Equal per-rank work inside FSDP2: when the trained transitions differ by rank (a random selection or
window drawn differently per rank), every rank still makes the same number of sharded forwards per
mini-batch (:func:`posttrain.grpo.ranks.equal_chunks` pads with zero-weight repeats), counted on the
wrapped blocks with 2 gloo ranks; the padding adds nothing to the gradients."""

import pytest
import torch

from posttrain.grpo.ranks import equal_chunks
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from tests.distributed.common import flow_loss, full_grads, tiny_batch, tiny_model

pytestmark = pytest.mark.core

SELECTED = [[0, 2], [1, 3, 4]]  # rank 0 trains 2 transitions, rank 1 trains 3


def _train(rank, world, pad: bool):
    model = parallelize(tiny_model(), ParallelDims().build_mesh(), ParallelConfig())
    calls = []
    for block in model.transformer.transformer_blocks:
        block.register_forward_hook(lambda *a: calls.append(1))
    mine = SELECTED[rank]
    chunks = equal_chunks(mine, 1) if pad else [([t], True) for t in mine]
    for chunk, real in chunks:
        x, sigma, embeds, v = tiny_batch(2, seed=10 + chunk[0])  # the transition's inputs
        loss = flow_loss(model, x, sigma, embeds, v)
        (loss * (1.0 if real else 0.0)).backward()
    grads = full_grads(model)
    return {"forwards": len(calls) // len(model.transformer.transformer_blocks), "padded": sum(not r for _, r in chunks),
            "grad": {k: g for k, g in grads.items()}}


def test_every_rank_makes_the_same_number_of_sharded_forwards():
    results = run_ranks(_train, True, world_size=2)
    assert [r["forwards"] for r in results] == [3, 3]
    assert [r["padded"] for r in results] == [1, 0]


def _reference(rank, world):
    """The real chunks only, without FSDP, summed over both ranks' selections and averaged as FSDP's
    reduce-scatter averages over 2 ranks."""
    model = tiny_model()
    for t in SELECTED[0] + SELECTED[1]:
        x, sigma, embeds, v = tiny_batch(2, seed=10 + t)
        (flow_loss(model, x, sigma, embeds, v) / 2).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.long  # make test keeps the equal forward count and the refusal
def test_padding_adds_nothing_to_the_gradients():
    results = run_ranks(_train, True, world_size=2)
    want = run_ranks(_reference, world_size=2)[0]
    got = results[0]["grad"]
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def _empty(rank, world):
    ParallelDims().build_mesh()
    with pytest.raises(ValueError, match="no transition"):
        equal_chunks([] if rank == 0 else [1, 2], 1)
    return True


def test_a_rank_without_transitions_is_refused_on_every_rank():
    assert run_ranks(_empty, world_size=2) == [True, True]
