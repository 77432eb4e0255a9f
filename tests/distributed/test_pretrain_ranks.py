"""`posttrain pretrain` on 2 gloo ranks vs 1 process on the same seeds (tiny preset, 2 optimizer steps).

Both runs draw the same global micro-batches (train.batch_size 16, accumulation 2) and per-sample
noise; each rank trains its 8 samples of every micro-batch. Only the batching of the forwards and the
order of float sums differ (FSDP2 reduce-scatter), which the tolerances below measure. EMA on 2 ranks
is refused with a config error before any model is built."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.config import ConfigError
from pretrain.parallel.launch import run_ranks
from pretrain.runtime.metrics import read_metrics
from tests.conftest import tiny_config

pytestmark = pytest.mark.core

ARGS = ("train.steps=2", "train.threads=1", "train.batch_size=16", "train.grad_accum=2", "eval.every=0",
        "eval.heldout_samples=16", "eval.grid_every=2", "eval.grid_prompts=4", "eval.num_inference_steps=2",
        "optim.eps=1e-4")
# Measured (torch 2.14 CPU, printed by the test): loss 6e-8 relative; parameters 7e-9 = 1.2e-5 of the
# largest change (6e-4), i.e. one fp32 ulp of a parameter near 0.1. optim.eps=1e-4: with the default
# 1e-8, AdamW's first steps (lr * g / (|g| + eps)) turn the ~1e-7-relative gradient differences of
# near-zero gradients into update differences of up to 3e-7 (5e-4 of the change; measured).
LOSS_RTOL = 1e-5  # relative difference of each step's loss
PARAM_TOL = 1e-4  # max |parameter difference| / max |parameter change over the 2 steps|


def _weights(run_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "pretrain" / "export" / "diffusion_pytorch_model.safetensors"))


def _pretrain(rank, world, run_dir, overrides=()):
    import pretrain.trainer as trainer

    init, build = {}, trainer.build_backbone

    def keep_init(*args, **kwargs):  # the seeded initial weights, to measure how far training moved them
        model = build(*args, **kwargs)
        init.update({k: v.detach().clone() for k, v in model.transformer.state_dict().items()})
        return model

    trainer.build_backbone = keep_init
    out = trainer.train(tiny_config(run_dir, *ARGS, *overrides))
    if rank:
        return {"export": str(out)}
    run = Path(run_dir) / "pretrain"
    return {"export": str(out), "metrics": read_metrics(run / "metrics.jsonl"), "weights": _weights(run_dir),
            "init": init,
            "samples": sorted(p.name for p in (run / "samples").iterdir()),
            "checkpoints": sorted(p.name for p in (run / "checkpoints" / "step_2").glob("*.distcp"))}


def _ema(rank, world, run_dir):
    try:
        _pretrain(rank, world, run_dir, ("train.ema_decay=0.9",))
    except ConfigError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pretrain_ranks")
    one = run_ranks(_pretrain, str(d / "one"), world_size=1)[0]  # also warms the dataset cache
    two = run_ranks(_pretrain, str(d / "two"), world_size=2)
    return one["init"], one, two


def _compare(init, one, other):
    """(losses of one process, max relative loss difference, max |parameter difference|, max parameter
    change over the run) between the one-process run and ``other`` (rank 0's result)."""
    loss1 = [r["loss"] for r in one["metrics"] if "loss" in r]
    loss2 = [r["loss"] for r in other["metrics"] if "loss" in r]
    assert len(loss1) == len(loss2) == 2
    w1, w2 = one["weights"], other["weights"]
    assert set(w1) == set(w2) == set(init)
    return (loss1, max(abs(a - b) / abs(a) for a, b in zip(loss1, loss2)),
            max((w1[k] - w2[k]).abs().max().item() for k in w1), max((w1[k] - init[k]).abs().max().item() for k in w1))


def test_two_ranks_train_what_one_process_trains(runs, capsys):
    init, one, two = runs
    loss1, d_loss, d_param, moved = _compare(init, one, two[0])
    with capsys.disabled():
        print(f"\npretrain 1 vs 2 ranks: loss rel |d| {d_loss:.2e} (losses {loss1}); params max |d| "
              f"{d_param:.2e} vs max change {moved:.2e} (ratio {d_param / moved:.2e})")
    assert moved > 1e-4  # the weights did train
    assert d_loss <= LOSS_RTOL and d_param <= PARAM_TOL * moved


@pytest.mark.long  # make test keeps TP model equality (test_tensor_parallel)
def test_tensor_parallel_pretraining_trains_what_one_process_trains(runs, tmp_path, capsys):
    """TP 2 (one data shard: both ranks run every sample, each with half of every projection): the same
    losses and weights as one process, and a DCP checkpoint of the TP x FSDP shards. The replica check
    runs every step: TP ranks hold different shards and must not be compared as replicas."""
    init, one, _ = runs
    tp = run_ranks(_pretrain, str(tmp_path), ("parallel.tp=2", "train.replica_check_every=1"), world_size=2)[0]
    _, d_loss, d_param, moved = _compare(init, one, tp)
    with capsys.disabled():
        print(f"\npretrain 1 process vs TP 2: loss rel |d| {d_loss:.2e}; params max |d| {d_param:.2e} vs max change "
              f"{moved:.2e} (ratio {d_param / moved:.2e})")
    assert d_loss <= LOSS_RTOL and d_param <= PARAM_TOL * moved
    assert tp["checkpoints"] == ["__0_0.distcp", "__1_0.distcp"]


def test_rank_0_writes_one_run(runs):
    _, one, two = runs
    steps = [r["step"] for r in two[0]["metrics"]]
    assert steps == [r["step"] for r in one["metrics"]] == [0, 1, 2]  # one line per step, rank 0 alone
    assert two[0]["samples"] == one["samples"] == ["heldout_step_000002.png"]
    assert two[0]["checkpoints"] == ["__0_0.distcp", "__1_0.distcp"]  # DCP shards of both ranks
    assert two[0]["export"] == two[1]["export"]


def test_ema_with_fsdp_is_a_config_error(tmp_path):
    messages = run_ranks(_ema, str(tmp_path), world_size=2)
    for m in messages:
        assert m is not None and "train.ema_decay=0.9" in m and "FSDP2-sharded" in m and "AveragedModel" in m
