"""Sharded DCP checkpoints on 2 ranks: resuming an FSDP2 run reproduces the uninterrupted one bitwise
(model, optimizer, per-rank RNG, per-rank sampler position), for full fine-tuning, for LoRA with a
bf16 base, and for full fine-tuning under tensor parallelism (TP 2: 2-D DTensor shards)."""

import pytest
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import Runtime
from tests.distributed.common import full_params, tiny_batch, tiny_model
from pretrain.parallel.launch import run_ranks
from tests.distributed.test_lora import _with_lora

pytestmark = pytest.mark.core


class Position:
    """A sampler position that differs per rank."""

    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _build(mesh, lora: bool, ckpt, rank: int):
    """The tiny model (LoRA: bf16 base) parallelized over ``mesh``, its Runtime and a per-rank position."""
    model = _with_lora(tiny_model()) if lora else tiny_model()
    parallelize(model, mesh, ParallelConfig(param_dtype="bf16" if lora else "fp32"))
    position = Position(1000 * rank)
    rt = Runtime(model, RuntimeConfig(steps=3, batch_size=2), OptimConfig(lr=1e-2, grad_clip=0.05),
                 torch.device("cpu"), ckpt, stateful={"sampler": position})
    return model, rt, position


def _step(model, rt, position, rank, tp=False):
    x, sigma, embeds, _ = tiny_batch(4, seed=rt.step)
    mine = slice(0, 2) if tp else slice(2 * rank, 2 * rank + 2)  # a TP group trains the same samples
    noise = torch.randn(2, 3, 16, 16)  # the global RNG, which differs per rank
    noise = noise.zero_() if tp else noise
    loss = (model(x[mine], sigma[mine], embeds[mine]) - noise).pow(2).mean()
    rt.backward(loss)
    position.value += 1
    return rt.optimizer_step(loss.item())


def _resume(rank, world, out, lora, tp=False):
    mesh = ParallelDims(dp_shard=1, tp=2).build_mesh() if tp else ParallelDims().build_mesh()
    ckpt = out / ("tp" if tp else "lora" if lora else "full")
    model, rt, position = _build(mesh, lora, ckpt, rank)
    torch.manual_seed(100 + rank)
    metrics = _step(model, rt, position, rank, tp)
    rt.save()
    _step(model, rt, position, rank, tp)
    expected = full_params(model), position.value, torch.rand(3)

    torch.manual_seed(7)  # a fresh process state: other RNG, other initial position
    model, rt, position = _build(mesh, lora, ckpt, rank)
    rt.start(resume=True)
    resumed_step = rt.step
    _step(model, rt, position, rank, tp)
    got = full_params(model), position.value, torch.rand(3)
    return dict(expected=expected, got=got, resumed_step=resumed_step, grad_norm=metrics["grad_norm"])


def _scenarios(rank, world, out):
    return dict(full=_resume(rank, world, out, False), lora=_resume(rank, world, out, True),
                tp=_resume(rank, world, out, False, tp=True))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_scenarios, tmp_path_factory.mktemp("fsdp_ckpt"))


@pytest.mark.parametrize("variant", ["full", "lora", "tp"])
def test_sharded_resume_reproduces_uninterrupted_run(results, variant):
    draws = []
    for rank, r in enumerate(results):
        r = r[variant]
        assert r["resumed_step"] == 1 and r["grad_norm"] > 0.05  # clipped: the norm is all ranks'
        (params, pos, draw), (params2, pos2, draw2) = r["expected"], r["got"]
        assert pos == pos2 == 1000 * rank + 2
        assert torch.equal(draw, draw2)
        draws.append(draw)
        assert set(params) == set(params2)
        for k in params:
            assert torch.equal(params[k], params2[k]), k
    assert not torch.equal(*draws)  # each rank restored its own RNG stream
    assert results[0][variant]["grad_norm"] == results[1][variant]["grad_norm"]
