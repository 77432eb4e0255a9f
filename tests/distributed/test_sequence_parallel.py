"""Ulysses sequence parallelism (SP = 2) on the tiny SD3 transformer equals SP = 1."""

import pytest

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.sequence import enable_sequence_parallel
from tests.distributed.common import full_grads, tiny_batch, tiny_model
from pretrain.parallel.launch import run_ranks

pytestmark = pytest.mark.core


def _sp_vs_single(rank, world):
    mesh = ParallelDims(dp_shard=1, sp=2).build_mesh()
    ref, model = tiny_model(), tiny_model()
    enable_sequence_parallel(model, mesh.sp_group)
    parallelize(model, mesh, ParallelConfig())  # FSDP over the 2 SP ranks, gradients summed over them
    seen = []
    model.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    x, sigma, embeds, v = tiny_batch(2)  # the same full batch (and noise) on both SP ranks
    out, out_ref = model(x, sigma, embeds), ref(x, sigma, embeds)
    (out - v).pow(2).mean().backward()
    (out_ref - v).pow(2).mean().backward()
    out, out_ref = out.detach(), out_ref.detach()
    grads, grads_ref = full_grads(model), full_grads(ref)
    assert set(grads) == set(grads_ref)
    result = dict(tokens_per_rank=seen[0], out_diff=float((out - out_ref).abs().max()),
                  out_max=float(out_ref.abs().max()),
                  grad_diff=max(float((grads[k] - grads_ref[k]).abs().max()) for k in grads),
                  grad_max=max(float(g.abs().max()) for g in grads_ref.values()))
    errors = {}
    try:
        enable_sequence_parallel(tiny_model(preset="small"), mesh.sp_group)  # 3 heads
    except ValueError as e:
        errors["heads"] = str(e)
    try:
        odd = tiny_model()
        enable_sequence_parallel(odd, mesh.sp_group)
        odd(x[:, :, :12, :12], sigma, embeds)  # 3 x 3 = 9 image tokens
    except ValueError as e:
        errors["tokens"] = str(e)
    return result, errors


@pytest.fixture(scope="module")
def results():
    return run_ranks(_sp_vs_single)


def test_sp2_outputs_and_gradients_equal_sp1(results):
    for result, _ in results:
        print(result)
        assert result["tokens_per_rank"] == 8  # 16 image tokens split over 2 ranks
        assert result["out_max"] > 0.1 and result["grad_max"] > 1e-3
        assert result["out_diff"] <= 1e-5 and result["grad_diff"] <= 1e-5


def test_sp_degree_must_divide_heads_and_tokens(results):
    for _, errors in results:
        assert errors["heads"] == "sequence parallel: sp=2 does not divide num_attention_heads=3"
        assert errors["tokens"] == "sequence parallel: sp=2 does not divide the 9 image tokens"
