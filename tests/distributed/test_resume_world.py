"""Resume on another world size: a GRPO checkpoint written by 4 gloo ranks resumes on 2 and on 1; a
pretraining checkpoint written by 2 resumes on 4 (the data-parallel degree changes; DCP reshards the
model, the optimizer state, the EMA and the old policy; RNG states and data positions come from rank 0).

The global batch and the sample stream by global index are kept (prompts and noise are keyed by global
sample index, every rank draws the same prompt / sample indices), so the resumed run trains on what the
uninterrupted run at the old size trains on; it differs from it only by the order of float sums of
another number of ranks (FSDP2 reduce-scatter), which the tolerances below measure. The cheap form in
``make test``: ``test_grpo_torchrun.py`` resumes a 2-rank GRPO checkpoint in one process."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from pretrain.parallel.launch import run_ranks
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config, tiny_config

pytestmark = pytest.mark.long

REWARD = "tests.distributed.test_grpo_ranks:brightness"
GRPO = ("train.threads=1", "train.batch_size=16", "rollout.batch_size=4", "eval.grid_prompts=4",
        "checkpoint.every=1", "checkpoint.keep_last=5", "optim.eps=1e-4")
PRETRAIN = ("train.threads=1", "train.batch_size=16", "eval.every=0", "eval.grid_every=0", "checkpoint.every=2",
            "checkpoint.keep_last=5", "train.ema_decay=0.9", "optim.eps=1e-4")
REWARD_TOL = 1e-6  # iteration 2's mean reward
WEIGHT_TOL = 1e-4  # max |weight difference| / max |weight change|


def _grpo(rank, world, export, run_dir, steps, resume, overrides=()):
    from posttrain.grpo.stage import train

    cfg = grpo_config(run_dir, export, *GRPO, *overrides, f"train.steps={steps}", f"checkpoint.resume={resume}")
    cfg.rewards = {REWARD: 1.0}
    out = train(cfg)
    if rank:
        return None
    return {"rewards": [r["reward_mean"] for r in read_metrics(Path(run_dir) / "grpo/metrics.jsonl")
                        if "reward_mean" in r],
            "export": load_file(str(Path(out) / "diffusion_pytorch_model.safetensors"))}


def _pretrain(rank, world, run_dir, steps, resume):
    from pretrain.trainer import train

    out = train(tiny_config(run_dir, *PRETRAIN, f"train.steps={steps}", f"checkpoint.resume={resume}"))
    if rank:
        return None
    return {"losses": [r["loss"] for r in read_metrics(Path(run_dir) / "pretrain/metrics.jsonl") if "loss" in r],
            "export": load_file(str(Path(out) / "diffusion_pytorch_model.safetensors"))}


def _compare(name, a, b, base, capsys, key):
    moved = max((a["export"][k] - base[k]).abs().max().item() for k in a["export"] if k in base)
    d_w = max((a["export"][k] - b["export"][k]).abs().max().item() for k in a["export"])
    with capsys.disabled():
        print(f"\n{name}: {key} {a[key]} vs {b[key]}; exported weights max |d| {d_w:.2e} vs largest change "
              f"{moved:.2e} (ratio {d_w / moved:.1e})")
    assert d_w <= WEIGHT_TOL * moved
    return moved


def test_grpo_written_by_4_ranks_resumes_on_2_and_on_1(tiny_export, tmp_path, capsys):
    import shutil

    export = str(tiny_export)
    straight = run_ranks(_grpo, export, str(tmp_path / "straight"), 2, False, world_size=4)[0]
    run_ranks(_grpo, export, str(tmp_path / "four"), 1, False, world_size=4)  # checkpoint step_1 on 4 ranks
    shutil.copytree(tmp_path / "four", tmp_path / "four_to_one")
    on2 = run_ranks(_grpo, export, str(tmp_path / "four"), 2, True, world_size=2)[0]
    on1 = run_ranks(_grpo, export, str(tmp_path / "four_to_one"), 2, True, world_size=1)[0]
    base = load_file(str(Path(export) / "diffusion_pytorch_model.safetensors"))
    for name, resumed in (("GRPO 4 ranks -> 2", on2), ("GRPO 4 ranks -> 1", on1)):
        assert resumed["rewards"][0] == straight["rewards"][0]  # iteration 1: logged by the 4-rank run
        assert abs(resumed["rewards"][1] - straight["rewards"][1]) <= REWARD_TOL
        assert _compare(name + " vs 4 ranks straight", resumed, straight, base, capsys, "rewards") > 1e-4


def test_pretraining_written_by_2_ranks_resumes_on_4(tmp_path, capsys):
    straight = run_ranks(_pretrain, str(tmp_path / "straight"), 4, False, world_size=2)[0]
    half = run_ranks(_pretrain, str(tmp_path / "two"), 2, False, world_size=2)[0]  # checkpoint step_2, 2 ranks
    on4 = run_ranks(_pretrain, str(tmp_path / "two"), 4, True, world_size=4)[0]
    assert len(on4["losses"]) == 4 and on4["losses"][:2] == straight["losses"][:2]  # steps 1-2: the 2-rank run's
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(on4["losses"], straight["losses"]))
    # the EMA export after steps 3-4, against its change since step 2
    assert _compare("pretraining 2 ranks -> 4 vs 2 ranks straight", on4, straight, half["export"], capsys,
                    "losses") > 1e-5


def test_nft_written_by_2_ranks_resumes_its_old_policy_on_1(tiny_export, tmp_path, capsys):
    """NFT's old policy is checkpointed as DTensor shards: one process reads it whole."""
    from tests.integration.test_forward_process import LOSSES, ODE

    nft = (*ODE, LOSSES["nft"])
    export = str(tiny_export)
    straight = run_ranks(_grpo, export, str(tmp_path / "straight"), 2, False, nft, world_size=2)[0]
    run_ranks(_grpo, export, str(tmp_path / "two"), 1, False, nft, world_size=2)
    on1 = run_ranks(_grpo, export, str(tmp_path / "two"), 2, True, nft, world_size=1)[0]
    assert on1["rewards"][0] == straight["rewards"][0]
    assert abs(on1["rewards"][1] - straight["rewards"][1]) <= REWARD_TOL  # sampled with the resumed old policy
    base = load_file(str(Path(export) / "diffusion_pytorch_model.safetensors"))
    assert _compare("NFT 2 ranks -> 1 vs 2 ranks straight", on1, straight, base, capsys, "rewards") > 1e-4
