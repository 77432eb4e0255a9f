"""Registered parts: an advantage estimator written in this file is chosen by name in the config and
trains, with no project file edited; bad names and options are config errors naming the key."""

from dataclasses import dataclass

import pytest
import torch

from posttrain.grpo.stage import train as grpo_train
from posttrain.grpo.parts.registry import ADVANTAGES
from pretrain.config import ConfigError
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config

CALLS = []


class RankAdvantage:
    """Rank-based advantages: within each prompt group, the centred, standardised rank of each reward
    (ties broken by order), plus ``offset``."""

    @dataclass
    class Config:
        offset: float = 0.0

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, total, raw, weights, group_ids, prompt_ids):
        adv = torch.zeros_like(total)
        for g in torch.unique(group_ids):
            idx = torch.nonzero(group_ids == g).flatten()
            ranks = torch.argsort(torch.argsort(total[idx])).float()
            adv[idx] = (ranks - ranks.mean()) / ranks.std(unbiased=False)
        adv = adv + self.cfg.offset
        CALLS.append(adv.clone())
        valid = torch.isfinite(total)
        return adv, valid, torch.zeros_like(valid)


@pytest.fixture
def rank_advantage():
    ADVANTAGES.register("test_rank")(RankAdvantage)
    CALLS.clear()
    yield
    ADVANTAGES.unregister("test_rank")


def test_rank_advantage_has_its_closed_form(rank_advantage):
    est = ADVANTAGES.build({"name": "test_rank", "offset": 0.25}, "grpo.advantage")
    adv, valid, zero = est(torch.tensor([0.3, 0.1, 0.9, 0.5, 2.0, 1.0]), {}, {}, torch.tensor([0, 0, 0, 0, 1, 1]),
                           torch.tensor([7, 7, 7, 7, 3, 3]))
    s = 1.25 ** 0.5  # population std of the ranks 0..3
    want = torch.tensor([-0.5 / s, -1.5 / s, 1.5 / s, 0.5 / s, 1.0, -1.0]) + 0.25
    torch.testing.assert_close(adv, want)
    assert valid.all() and not zero.any()


def test_grpo_trains_with_an_advantage_registered_in_a_test_file(rank_advantage, tiny_export, tmp_path):
    # beta 0 and one optimizer step per iteration: the first iteration's ratios are 1, so its loss is
    # mean(-A) over the samples = -offset exactly what this estimator returned (ranks are centred)
    cfg = grpo_config(tmp_path, tiny_export, "train.steps=2", "grpo.advantage.name=test_rank",
                      "grpo.advantage.offset=0.5", "grpo.loss.beta=0.0", "train.batch_size=16")
    grpo_train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert len(CALLS) == 2 and all(c.shape == (16,) for c in CALLS)
    assert abs(float(CALLS[0].mean()) - 0.5) < 1e-6
    for rec in recs:  # each iteration samples from the policy it trains: ratios start at 1 every time
        assert rec["ratio_min"] > 1 - 1e-5 and rec["ratio_max"] < 1 + 1e-5
        assert abs(rec["loss"] + 0.5) < 1e-4 and rec["grad_norm"] > 0, rec
    # with the built-in group estimator the advantages are centred: the same loss is about 0
    grpo_train(grpo_config(tmp_path / "group", tiny_export, "train.steps=1", "grpo.loss.beta=0.0", "train.batch_size=16"))
    assert abs(read_metrics(tmp_path / "group/grpo/metrics.jsonl")[0]["loss"]) < 1e-4


def test_a_part_named_by_import_path_needs_no_registration(tiny_export, tmp_path):
    # a file that sets the group estimator's option: remove it with ~key when switching parts
    with pytest.raises(ConfigError, match=r"grpo\.advantage\.clip_max: not an option of .* ~grpo\.advantage\.clip_max"):
        grpo_config(tmp_path, tiny_export, "grpo.advantage.clip_max=5.0",
                    "grpo.advantage.name=tests.integration.test_parts:RankAdvantage")
    cfg = grpo_config(tmp_path, tiny_export, "grpo.advantage.clip_max=5.0", "~grpo.advantage.clip_max",
                      "grpo.advantage.name=tests.integration.test_parts:RankAdvantage", "grpo.advantage.offset=2.0")
    est = cfg.grpo.build().advantage
    assert isinstance(est, RankAdvantage) and est.cfg.offset == 2.0
    adv, _, _ = est(torch.tensor([1.0, 3.0]), {}, {}, torch.tensor([0, 0]), torch.tensor([5, 5]))
    assert adv.tolist() == [1.0, 3.0]  # ranks -1, +1, plus 2


def test_unknown_part_names_and_options_name_the_key(tiny_export, tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.advantage\.name: unknown advantage estimator 'nope'; known: "):
        grpo_config(tmp_path, tiny_export, "grpo.advantage.name=nope")
    with pytest.raises(ConfigError, match=r"grpo\.loss\.clip_rang: not an option of policy loss 'ppo_clip_kl' "
                                          r"\(its options: clip_range, beta\)"):
        grpo_config(tmp_path, tiny_export, "grpo.loss.clip_rang=0.1")
    with pytest.raises(ConfigError, match=r"grpo\.loss\.clip_range: must be > 0"):
        grpo_config(tmp_path, tiny_export, "grpo.loss.clip_range=0")
