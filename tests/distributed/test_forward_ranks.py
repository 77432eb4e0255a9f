"""The forward-process losses (DiffusionNFT, AWM, DGPO) on 2 gloo ranks (FSDP2) vs 1 process, same seeds.

ODE rollouts with the tiny preset and a continuous reward (mean brightness); rollout batch 8 is one
rank's share of 4 prompts x group 4, so iteration 1 samples bitwise alike; ``train.batch_size`` 16 is
one mini-batch of the whole buffer, so both layouts update on the same samples (the draws are keyed by
global sample index). NFT samples with its old weights, swapped into the sharded policy; full
fine-tuning keeps them as one shard per rank. Only the order of float sums differs (FSDP2
reduce-scatter), which iteration 2's rewards and the exported weights measure."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from pretrain.parallel.launch import run_ranks
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config
from tests.integration.test_forward_process import LOSSES, ODE

pytestmark = pytest.mark.core

REWARD = "tests.distributed.test_grpo_ranks:brightness"
ARGS = ("train.threads=1", "train.batch_size=16", "train.steps=2", "eval.grid_prompts=4", "checkpoint.every=0",
        "optim.eps=1e-4")  # eps: as test_pretrain_ranks, so Adam does not blow up 1e-7 gradient differences
REWARD_TOL = 1e-6  # max |reward difference| in iteration 2
# max |weight difference| / max |weight change over the run|. Measured (torch 2.14 CPU, printed): LoRA NFT
# 2.7e-6, AWM 4.4e-6, DGPO 4.3e-6; full NFT 1.0e-5. (Before the swap resharded FSDP2's root, whose
# gathered weights outlive a forward, the policy's forward after the old one ran on stale root weights:
# NFT full 2.0e-2, LoRA 3.1e-4.)
WEIGHT_TOL = 1e-4
CASES = {"nft": (), "awm": (), "dgpo": (), "nft_full": ("policy.lora_rank=0",),
         "nft_sp": ("parallel.sp=2",), "dgpo_tp": ("parallel.tp=2",),
         "dgpo_ptx": ("data_loss.weight=1", "data_loss.batch_size=6")}  # each rank: 3 of 6 train images
LONG = {"awm", "nft_full", "nft_sp", "dgpo_tp", "dgpo_ptx"}  # make test: NFT (LoRA) and DGPO on 2 data-parallel ranks


def _forward(rank, world, export, run_dir, loss, overrides):
    from posttrain.grpo.stage import train

    cfg = grpo_config(run_dir, export, *ODE, LOSSES[loss], *ARGS, *overrides)
    cfg.rewards = {REWARD: 1.0}
    out = train(cfg)
    if rank:
        return None
    run = Path(run_dir) / "grpo"
    return {"rewards": [r["reward_mean"] for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r],
            "export": load_file(str(Path(out) / "diffusion_pytorch_model.safetensors"))}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.long) if c in LONG else c for c in sorted(CASES)])
def test_two_ranks_train_what_one_process_trains(case, tiny_export, tmp_path, capsys):
    loss, overrides = case.split("_")[0], CASES[case]
    one = run_ranks(_forward, str(tiny_export), str(tmp_path / "one"), loss, overrides, world_size=1)[0]
    two = run_ranks(_forward, str(tiny_export), str(tmp_path / "two"), loss, overrides, world_size=2)[0]
    base = load_file(str(Path(tiny_export) / "diffusion_pytorch_model.safetensors"))
    assert len(one["rewards"]) == len(two["rewards"]) == 2
    assert one["rewards"][0] == two["rewards"][0]  # iteration 1: the same weights, the same samples
    d_reward = abs(one["rewards"][1] - two["rewards"][1])
    w1, w2 = one["export"], two["export"]
    assert set(w1) == set(w2)
    moved = max((w1[k] - base[k]).abs().max().item() for k in w1 if k in base)
    d_weight = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    with capsys.disabled():
        print(f"\n{case} 1 vs 2 ranks: rewards {one['rewards']} vs {two['rewards']} (iteration 2 |d| {d_reward:.1e}); "
              f"exported weights max |d| {d_weight:.2e} vs largest change {moved:.2e} (ratio {d_weight / moved:.1e})")
    assert moved > 1e-4  # the policy trained
    assert d_reward <= REWARD_TOL and d_weight <= WEIGHT_TOL * moved and d_weight <= 1e-6
