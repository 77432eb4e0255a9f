"""`posttrain pretrain` on 2 gloo ranks vs 1 process on the same seeds (tiny preset, 2 optimizer steps).

Both runs draw the same global micro-batches (train.batch_size 16, accumulation 2) and per-sample
noise; each rank trains its 8 samples of every micro-batch. Only the batching of the forwards and the
order of float sums differ (FSDP2 reduce-scatter), which the tolerances below measure. EMA on 2 ranks
(sharded like the parameters) exports what one process exports and resumes bit for bit."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.parallel.launch import run_ranks
from pretrain.runtime.metrics import read_metrics
from pretrain.runtime.runtime import Runtime
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


EMA_ARGS = ("train.ema_decay=0.9", "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=5",
            "optim.schedule=cosine", "optim.warmup_steps=1")
EMA_TOL = 1e-6  # max |EMA weight difference|, 2 ranks against one process


class _Stop(Exception):
    pass


def _ema_resume(rank, world, run_dir):
    """Pretraining with EMA straight for 4 steps, then again interrupted after the step-2 checkpoint and
    resumed: (straight, resumed) results, each with its export (the EMA weights) and losses."""
    straight = _pretrain(rank, world, f"{run_dir}/straight", EMA_ARGS)
    if world == 1:
        return straight, None
    save = Runtime.save

    def save_then_stop(self):
        path = save(self)
        if self.step == 2:
            raise _Stop
        return path

    Runtime.save = save_then_stop
    try:
        _pretrain(rank, world, f"{run_dir}/resumed", EMA_ARGS)
        raise AssertionError("the run did not stop at step 2")
    except _Stop:
        pass
    finally:
        Runtime.save = save
    return straight, _pretrain(rank, world, f"{run_dir}/resumed", (*EMA_ARGS, "checkpoint.resume=true"))


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


def test_ema_on_two_ranks_equals_one_process_and_resumes_bitwise(runs, tmp_path, capsys):
    _, plain, _ = runs  # 2 steps without EMA, the same seeds
    one = run_ranks(_ema_resume, str(tmp_path / "one"), world_size=1)[0][0]
    (two, resumed), _ = run_ranks(_ema_resume, str(tmp_path / "two"), world_size=2)
    w1, w2, wr = one["weights"], two["weights"], resumed["weights"]
    assert set(w1) == set(w2) == set(wr) == set(plain["weights"])
    d_ema = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    off = max((w1[k] - plain["weights"][k]).abs().max().item() for k in w1)  # EMA of 4 steps vs 2 raw steps
    with capsys.disabled():
        print(f"\nEMA pretraining 1 vs 2 ranks: exported EMA weights max |d| {d_ema:.2e} (tolerance {EMA_TOL}); "
              f"EMA export vs the raw 2-step weights {off:.2e}")
    assert d_ema <= EMA_TOL and off > 1e-5
    assert all(torch.equal(w2[k], wr[k]) for k in w2)  # resumed from step 2 on 2 ranks: bitwise
    losses = [[r["loss"] for r in run["metrics"] if "loss" in r] for run in (two, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert two["checkpoints"] == ["__0_0.distcp", "__1_0.distcp"]
