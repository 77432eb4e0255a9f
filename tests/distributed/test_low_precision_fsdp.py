"""FSDP2 over torchao's emulated FP8 layers on 2 gloo ranks equals one process running the same converted
model with each rank's share as one micro-batch of a 2-step accumulation (FP8 scales are per micro-batch,
so that is the single-process run with the same casts): row-wise scales, and tensor-wise with the FP8
all-gather (weight scales from the full weight, precomputed after each optimizer step)."""

import pytest
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.low_precision import LowPrecisionConfig, convert
from pretrain.runtime.runtime import Runtime
from tests.distributed.common import flow_loss, full_params, tiny_batch, tiny_model

from tests.conftest import require_extra  # noqa: E402

pytestmark = pytest.mark.core

require_extra("torchao", "lowp")
MICRO, STEPS = 4, 2


def _train(model, rank, world, tmp):
    """STEPS optimizer steps; with ``world`` 1 each step accumulates both ranks' shares in turn. Returns
    (the step losses, the parameters after the first step)."""
    rt = Runtime(model, RuntimeConfig(steps=STEPS), OptimConfig(lr=1e-2), torch.device("cpu"), f"{tmp}/checkpoints")
    losses, after_first = [], None
    for step in range(STEPS):
        x, sigma, embeds, v = tiny_batch(MICRO * 2, seed=step)
        total = 0.0
        for share in ([rank] if world > 1 else [0, 1]):
            mine = slice(share * MICRO, (share + 1) * MICRO)
            loss = flow_loss(model, x[mine], sigma[mine], embeds[mine], v[mine]) / (2 // world)
            rt.backward(loss)
            total += loss.item()
        rt.optimizer_step(total)
        losses.append(total)
        after_first = after_first or full_params(model)
    return losses, after_first


def _fsdp_low_precision(rank, world, tmp, recipe, all_gather):
    model = tiny_model()
    convert(model.transformer, LowPrecisionConfig(recipe=recipe, emulate=True, fp8_all_gather=all_gather))
    parallelize(model, ParallelDims().build_mesh(), ParallelConfig())
    losses, params = _train(model, rank, world, f"{tmp}/sharded")
    return {"losses": losses, "params": params,
            "float8": sum(type(m).__name__ == "Float8Linear" for m in model.modules())}


@pytest.mark.long  # make test keeps FSDP equality (test_fsdp.py) and FP8 numerics in one process (test_low_precision.py)
@pytest.mark.parametrize("recipe,all_gather", [("fp8_rowwise", False), ("fp8_tensorwise", True)])
def test_fsdp_over_fp8_layers_equals_one_process(tmp_path, recipe, all_gather):
    results = run_ranks(_fsdp_low_precision, str(tmp_path), recipe, all_gather, world_size=2)
    ref = tiny_model()  # the same converted model in this (plain) process
    convert(ref.transformer, LowPrecisionConfig(recipe=recipe, emulate=True))
    start = full_params(ref)
    losses, single = _train(ref, 0, 1, tmp_path / "single")
    assert results[0]["float8"] == results[1]["float8"] > 0
    params = results[0]["params"]
    diff = max(float((params[k] - single[k]).abs().max()) for k in single)
    change = max(float((single[k] - start[k]).abs().max()) for k in single)
    # the second step's loss: a forward through weights updated once (with the FP8 all-gather, cast with
    # the scales precomputed from the full weights after the optimizer step)
    mean = [sum(r["losses"][1] for r in results) / 2, losses[1]]
    print(f"\n{recipe} FSDP 2 ranks vs 1 process: after step 1 params max |d| {diff:.2e} vs change {change:.2e}; "
          f"step-2 loss {mean[0]:.7f} vs {mean[1]:.7f}")
    assert diff / change < 1e-3  # Adam turns the reduction order's rounding into ~1e-4 of the change
    assert abs(mean[0] / mean[1] - 1) < 1e-6
