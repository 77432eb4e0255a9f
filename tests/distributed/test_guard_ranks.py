"""The reward-hacking guard on 2 gloo ranks (as under `torchrun --nproc_per_node 2`): every rank probes the same held-out prompts
with the same seeds through the sharded policy, rank 0's decision is broadcast, and the run logs the
checks one process logs (values within float rounding) and stops at the same step on a planted hack
(brightness rewarded while any rise of the held-out loss counts as worse)."""

import math

import pytest
import yaml

from pretrain.parallel.launch import run_ranks
from pretrain.runtime.metrics import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.core

REWARD = "tests.distributed.test_layout_grpo:brightness"  # mean pixel value: rises as the policy brightens
ARGS = ("train.steps=6", "guard.every=1", "guard.stop=true", "guard.checks=2", "guard.default_worse_by=1e-6",
        "checkpoint.every=0", "guard.num_prompts=8", "guard.num_inference_steps=6", "guard.loss_samples=32",
        "guard.guidance_scale=1.0", "optim.lr=5e-3", "grpo.loss.clip_range=0.05", "grpo.loss.beta=0.0",
        "rollout.guidance_scale=1.0", "data.limit=4", "rollout.group_size=8", "rollout.batch_size=16",
        "train.batch_size=32", "train.threads=1", "eval.grid_prompts=4")
TOL = 1e-6  # relative: 2 FSDP ranks against one process after a few optimizer steps (float32 rounding);
# one optimizer step per iteration, so both see the same mini-batch (docs/distributed.md: the shuffle is per rank)


def _grpo(rank, world, path, run_dir, overrides):
    from posttrain.grpo.stage import GRPOConfig, train
    from pretrain.config import load_config

    train(load_config(GRPOConfig, path, [f"run_dir={run_dir}", *overrides]))


def test_the_guard_on_two_ranks_checks_and_stops_as_one_process(tiny_export, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs/grpo/emoji_tiny.yaml").read_text())
    cfg["rewards"] = {REWARD: 1.0}
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    common = (f"model.pretrained={tiny_export}", *ARGS)
    for run, world in (("one", 1), ("two", 2)):
        run_ranks(_grpo, str(path), str(tmp_path / run), common, world_size=world)

    checks = {}
    for run in ("one", "two"):
        checks[run] = [r for r in read_metrics(tmp_path / run / "grpo/metrics.jsonl") if "guard/loss" in r]
    one, two = checks["one"], checks["two"]
    print(f"\nguard, 1 process vs 2 ranks: steps {[r['step'] for r in one]} vs {[r['step'] for r in two]}; "
          + "; ".join(f"step {a['step']} loss {a['guard/loss']:.6g} vs {b['guard/loss']:.6g}, trained "
                      f"{a['guard/trained']:.6g} vs {b['guard/trained']:.6g}" for a, b in zip(one, two)))
    assert [r["step"] for r in one] == [r["step"] for r in two]  # the same checks, the same stop
    stop = one[-1]
    assert stop["step"] < 6 and stop["guard/streak"] == 2 == two[-1]["guard/streak"]  # the planted hack stopped both
    diffs = [abs(float(b[k]) - float(a[k])) / abs(float(a[k])) for a, b in zip(one, two)
             for k in ("guard/loss", "guard/trained", "guard/diversity") if not math.isnan(float(a[k]))]
    print(f"largest relative difference of a check value: {max(diffs):.2e}")
    for a, b in zip(one, two):
        for key in ("guard/loss", "guard/trained", "guard/diversity"):
            x, y = float(a[key]), float(b[key])  # metrics.jsonl writes NaN as "nan"
            if math.isnan(x):
                assert math.isnan(y), key
            else:
                assert y == pytest.approx(x, rel=TOL), (a["step"], key, x, y)
        assert a["guard/failing"] == b["guard/failing"] and a["guard/best_step"] == b["guard/best_step"]
    assert (tmp_path / "two/grpo/export/posttrain.json").is_file()  # stopped early on every rank, and exported
    assert read_metrics(tmp_path / "two/grpo/metrics.jsonl")[-1]["step"] == stop["step"]
