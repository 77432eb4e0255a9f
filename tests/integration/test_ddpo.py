"""DDPO on the new core: the ``ddim`` step (eta = 1), PPO-clip without KL and DDPO's per-prompt
advantage tracking, whose buffers are checkpointed so a resumed run is the uninterrupted one."""

import pytest
import torch

from posttrain.grpo.stage import train as grpo_train
from posttrain.grpo.parts.registry import ADVANTAGES
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config

pytestmark = pytest.mark.core

DDPO = ("rollout.step=ddim", "rollout.noise_level=1.0", "rollout.timestep_fraction=1.0",
        "grpo.advantage={name: per_prompt, buffer_size: 8, min_count: 6}", "grpo.loss.beta=0.0",
        "rollout.guidance_scale=1.0", "train.batch_size=16")


def test_per_prompt_statistics_by_hand():
    est = ADVANTAGES.build({"name": "per_prompt", "buffer_size": 3, "min_count": 3, "clip_max": 5.0},
                           "grpo.advantage")
    r1, p1 = torch.tensor([1.0, 2.0, 3.0, float("nan")]), torch.tensor([0, 0, 1, 1])
    adv, valid, zero = est(r1, {}, {}, torch.tensor([0, 0, 1, 1]), p1)
    # no prompt has 3 rewards yet: the iteration's finite rewards {1, 2, 3} (mean 2, std sqrt(2/3))
    s = (2 / 3) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([-1 / (s + 1e-6), 0.0, 1 / (s + 1e-6), 0.0]))
    assert valid.tolist() == [True, True, True, False] and zero.tolist() == [False, False, False, True]
    saved = est.state_dict()
    r2, p2 = torch.tensor([4.0, 10.0]), torch.tensor([0, 0])
    adv2, _, _ = est(r2, {}, {}, torch.tensor([0, 0]), p2)
    # prompt 0's buffer keeps its last 3 rewards [2, 4, 10]: mean 16/3, population std
    buf = torch.tensor([2.0, 4.0, 10.0])
    torch.testing.assert_close(adv2, ((r2 - buf.mean()) / (buf.std(unbiased=False) + 1e-6)).clamp(-5, 5))
    again = ADVANTAGES.build({"name": "per_prompt", "buffer_size": 3, "min_count": 3}, "grpo.advantage")
    again.load_state_dict(saved)
    assert torch.equal(again(r2, {}, {}, torch.tensor([0, 0]), p2)[0], adv2)
    with pytest.raises(ValueError, match=r"grpo\.advantage\.min_count: must be in \[1, buffer_size=4\]"):
        ADVANTAGES.build({"name": "per_prompt", "buffer_size": 4, "min_count": 5}, "grpo.advantage")


def test_ddpo_resumes_with_its_prompt_statistics(tiny_export, tmp_path):
    """4 prompts of a prompt file, all drawn every iteration, 4 samples each: a prompt has 4 rewards after
    one iteration (< min_count: the batch statistics) and 8 after two (its own, across iterations), so a
    resume that lost the buffers would fall back to the batch statistics in iteration 3."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (tmp_path / "train.txt").write_text("a red apple\na green flag\na smiling face\na blue car\n")
    (tmp_path / "test.txt").write_text("a yellow star\n")
    data = ("data.source=prompts", f"data.path={tmp_path}")
    args = (*DDPO, *data, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=5")
    grpo_train(grpo_config(tmp_path / "a", tiny_export, *args))
    grpo_train(grpo_config(tmp_path / "b", tiny_export, *args[:-3], "train.steps=2", *args[-2:]))
    grpo_train(grpo_config(tmp_path / "b", tiny_export, *args, "checkpoint.resume=true"))
    recs = read_metrics(tmp_path / "a/grpo/metrics.jsonl")
    assert recs[0]["ratio_min"] > 1 - 1e-5 and recs[0]["ratio_max"] < 1 + 1e-5 and "kl" not in recs[0]
    states = {}
    for run in ("a", "b"):
        dcp_to_torch_save(tmp_path / run / "grpo/checkpoints/step_3", tmp_path / f"{run}.pt")
        states[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    a, b = states["a"], states["b"]
    assert a["stateful"]["grpo.advantage"] == b["stateful"]["grpo.advantage"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    rb = [r["loss"] for r in read_metrics(tmp_path / "b/grpo/metrics.jsonl")]
    assert [r["loss"] for r in recs] == rb
