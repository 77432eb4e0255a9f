"""``pairwise_remote``: win rates by hand (a group of 4 with a tie, a ranking), the seeded position
orders, the comparisons asked of a local chat-completions server (tests/integration/judge_server.py:
the larger JPEG wins), log-prob scoring, unreadable answers, and a GRPO iteration on the tiny preset whose
advantages are the hand-computed group advantages of the win rates."""

import itertools
import logging
import math

import pytest
import torch

from posttrain.objectives.advantages import group_advantages
from pretrain.config import ConfigError
from pretrain.seeding import seed_for
from rewards.jpeg import jpeg_size_kb
from rewards.pairwise import PairwiseJudge, win_rates_from_pairs, win_rates_from_ranking
from tests.integration.judge_server import JudgeServer

pytestmark = pytest.mark.core


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.stop()


def _images() -> torch.Tensor:
    """8 images in two groups of 4, of distinct JPEG sizes except images 1 and 2, which are equal (a tie)."""
    g = torch.Generator().manual_seed(0)
    base, noise = torch.rand(1, 3, 24, 24, generator=g), torch.rand(8, 3, 24, 24, generator=g)
    amount = torch.tensor([0.9, 0.4, 0.4, 0.1, 0.2, 0.8, 0.5, 0.05]).view(8, 1, 1, 1)
    images = ((1 - amount) * base + amount * noise).clamp(0, 1)
    images[2] = images[1]
    return images


def _hand_rates(sizes: list[float], groups: list[list[int]]) -> list[float]:
    out = [0.0] * len(sizes)
    for members in groups:
        for i in members:
            out[i] = sum(1.0 if sizes[i] > sizes[j] else 0.5 if sizes[i] == sizes[j] else 0.0
                         for j in members if j != i) / (len(members) - 1)
    return out


def test_win_rates_by_hand_for_a_group_of_four_with_a_tie():
    # 0 beats everyone, 1 and 2 tie and both beat 3
    pairs = [(0, 1, 1.0), (2, 0, 0.0), (0, 3, 1.0), (1, 2, 0.5), (1, 3, 1.0), (3, 2, 0.0)]
    assert win_rates_from_pairs(4, pairs).tolist() == [1.0, 0.5, 0.5, 0.0]
    # an unanswered comparison is dropped from both samples' counts, not scored
    dropped = [*pairs[:4], (1, 3, math.nan), pairs[5]]
    assert win_rates_from_pairs(4, dropped).tolist() == pytest.approx([1.0, 0.25, 0.5, 0.0])
    assert math.isnan(win_rates_from_pairs(5, pairs)[4])  # no comparison: NaN
    # a ranking: shown [2, 0, 3, 1] (sample per display position), answered display 2, 4, 1, 3 best first
    got = win_rates_from_ranking([2, 0, 3, 1], [1, 3, 0, 2], 5)
    assert got[:4].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0]) and math.isnan(got[4])
    assert torch.isnan(win_rates_from_ranking([0, 1], None, 2)).all()


def test_position_orders_are_seeded_and_both_orders_occur(server):
    pngs, prompts = [f"img{i}" for i in range(8)], ["p"] * 8
    meta = {"sample_ids": torch.arange(8, 16), "group_ids": torch.zeros(8), "iteration": 3}
    judge = PairwiseJudge(server.base_url, model="m")
    _, shown, _ = judge.questions(pngs, prompts, meta)
    assert len(shown) == 28 and {tuple(sorted(s)) for s in shown} == set(itertools.combinations(range(8), 2))
    swapped = [s[0] > s[1] for s in shown]
    assert swapped == [bool(seed_for(0, 3, 8 + a, 8 + b) & 1) for a, b in itertools.combinations(range(8), 2)]
    assert 0 < sum(swapped) < 28  # both orders are shown
    assert judge.questions(pngs, prompts, meta)[1] == shown  # the same run asks the same questions
    other = PairwiseJudge(server.base_url, model="m", order_seed=1).questions(pngs, prompts, meta)[1]
    assert other != shown
    ranking = PairwiseJudge(server.base_url, model="m", protocol="ranking").questions(pngs, prompts, meta)[1]
    assert len(ranking) == 1 and sorted(ranking[0]) == list(range(8)) and ranking[0] != list(range(8))


def test_pairs_and_ranking_against_the_server_equal_the_hand_win_rates(server, caplog):
    images = _images()
    sizes = [float(s) for s in jpeg_size_kb(images)]
    assert sizes[1] == sizes[2] and len(set(sizes)) == 7  # one tie, the rest distinct
    prompts = ["a"] * 4 + ["b"] * 4
    meta = {"sample_ids": torch.arange(8), "group_ids": torch.tensor([0] * 4 + [1] * 4), "iteration": 0}
    hand = _hand_rates(sizes, [[0, 1, 2, 3], [4, 5, 6, 7]])
    judge = PairwiseJudge(server.base_url, model="m", seed=5)
    assert judge(images, prompts, meta).tolist() == pytest.approx(hand)
    assert len(server.bodies) == 12  # 6 pairs per group (no start-up check: built directly, not from a config)
    pair_bodies = server.bodies
    assert all(len([p for p in b["messages"][0]["content"] if p["type"] == "image_url"]) == 2 for b in pair_bodies)
    assert all("seed" in b for b in pair_bodies) and len({b["seed"] for b in pair_bodies}) == 12
    # groups from equal prompts when no group_ids are given: the same answer
    assert judge(images, prompts).tolist() == pytest.approx(hand)
    # ranking: one request per group; the fake judge ranks consistently with its pairs, so the win rates
    # are the pairs' except for the tie (1 and 2), which a ranking must break: 1/3 apart, the same mean
    ranked = PairwiseJudge(server.base_url, model="m", protocol="ranking")
    n = len(server.bodies)
    got = ranked(images, prompts, meta).tolist()
    assert len(server.bodies) == n + 2
    assert [got[i] for i in (0, 3, 4, 5, 6, 7)] == pytest.approx([hand[i] for i in (0, 3, 4, 5, 6, 7)])
    assert hand[1] == hand[2] and sorted(got[1:3]) == pytest.approx([hand[1] - 1 / 6, hand[1] + 1 / 6])
    # a group of one and an unreadable answer are NaN / dropped and counted, never guessed
    with caplog.at_level(logging.WARNING, logger="rewards.pairwise"):
        alone = judge(images[:3], ["a", "a", "c"])
    assert alone[:2].tolist() == pytest.approx([1.0, 0.0]) and math.isnan(alone[2]) and judge.ungrouped_total == 1
    server.answer = lambda text, score: "I cannot tell"
    with caplog.at_level(logging.WARNING, logger="rewards.pairwise"):
        assert torch.isnan(judge(images[:2], ["a", "a"])).all()
    assert judge.unparsed_total == 1 and "I cannot tell" in caplog.text


def test_yes_prob_scoring_reads_the_first_image_token(server):
    ln = math.log
    server.top_logprobs = lambda text, sizes: [("1", ln(0.6)), ("2", ln(0.2)), ("tie", ln(0.2))]
    judge = PairwiseJudge(server.base_url, model="m", scoring="yes_prob")
    images = _images()[:2]
    got = judge(images, ["a", "a"], {"sample_ids": torch.tensor([0, 1]), "iteration": 0})
    first = judge.questions(["x", "y"], ["a", "a"], {"sample_ids": torch.tensor([0, 1]), "iteration": 0})[1][0][0]
    p_first = 0.6 / 0.8  # P("1") / (P("1") + P("2")): the image shown first is better with p 0.75
    expected = [p_first, 1 - p_first] if first == 0 else [1 - p_first, p_first]
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    assert server.bodies[-1]["logprobs"] is True
    with pytest.raises(ValueError, match="scoring must be text or yes_prob"):
        PairwiseJudge(server.base_url, model="m", protocol="ranking", scoring="yes_prob")


def test_grpo_with_the_pairwise_judge_trains_on_hand_computed_win_rate_advantages(server, tiny_export, tmp_path,
                                                                                 monkeypatch):
    """One GRPO iteration (4 prompts x 4): the advantages the update used equal the group advantages of the
    win rates computed by hand from the rollout images' JPEG sizes."""
    from posttrain.grpo.parts import group_advantage
    from posttrain.grpo.stage import train as grpo_train
    from tests.conftest import grpo_config

    seen, advantages = [], []
    call = PairwiseJudge.__call__

    def recording_call(self, images, prompts, metadata=None):
        if metadata and "group_ids" in metadata:  # the rollout's batches (not the start-up check)
            seen.append((images.clone(), list(metadata["group_ids"].tolist())))
        return call(self, images, prompts, metadata)

    def recording_advantages(rewards, group_ids, clip_max=5.0):
        out = group_advantages(rewards, group_ids, clip_max)
        advantages.append((rewards.clone(), group_ids.clone(), out[0].clone()))
        return out

    monkeypatch.setattr(PairwiseJudge, "__call__", recording_call)
    monkeypatch.setattr(group_advantage, "group_advantages", recording_advantages)
    cfg = grpo_config(tmp_path, tiny_export, "train.steps=1", "train.batch_size=16", "~rewards",
                      f"rewards={{pairwise_remote: {{weight: 1.0, base_url: '{server.base_url}', model: m}}}}")
    grpo_train(cfg)
    assert len(seen) == 2 and len(advantages) == 1  # two rollout batches of 8 = two whole groups each
    rates = []
    for images, groups in seen:
        sizes = [float(s) for s in jpeg_size_kb(images)]
        members = [[i for i, g in enumerate(groups) if g == k] for k in dict.fromkeys(groups)]
        rates += _hand_rates(sizes, members)
    rewards, group_ids, adv = advantages[0]
    assert rewards.tolist() == pytest.approx(rates, abs=1e-6)
    hand = torch.zeros(16, dtype=torch.float64)
    for g in group_ids.unique():
        r = torch.tensor(rates, dtype=torch.float64)[group_ids == g]
        hand[group_ids == g] = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
    assert adv.double().tolist() == pytest.approx(hand.clamp(-5, 5).tolist(), abs=1e-5)
    for g in group_ids.unique():  # each comparison hands out one point: a group of 4 sums to 2 (mean 0.5)
        assert rewards[group_ids == g].sum().item() == pytest.approx(2.0)
    assert adv.abs().max() > 0.5  # the judge told the samples apart


def test_a_rollout_batch_splitting_groups_is_refused_for_a_groupwise_reward(tiny_export, tmp_path, server):
    from tests.conftest import grpo_config

    with pytest.raises((ConfigError, ValueError), match=r"rollout\.batch_size: .*pairwise_remote"):
        grpo_config(tmp_path, tiny_export, "rollout.batch_size=6", "train.batch_size=16", "~rewards",
                    f"rewards={{pairwise_remote: {{weight: 1.0, base_url: '{server.base_url}', model: m}}}}")


def test_eval_records_each_judges_parameters_and_request_settings(server, tiny_export, tmp_path):
    """``eval.reward_params`` reaches the judges; ``eval.json`` records them (the key redacted) with each
    judge's request settings, and the same seeds give the same scores on a second evaluation."""
    import json

    from posttrain.eval.evaluate import EvalConfig, evaluate

    params = {"remote": {"base_url": server.base_url, "model": "m", "seed": 3, "temperature": 1.0,
                         "api_key": "secret"},
              "pairwise_remote": {"base_url": server.base_url, "model": "m", "seed": 4}}
    cfg = EvalConfig(rewards=["remote", "pairwise_remote"], reward_params=params, num_prompts=3,
                     samples_per_prompt=2, num_inference_steps=2, guard_samples=0, grid_prompts=2)
    cfg.validate()
    first = evaluate([str(tiny_export)], cfg, tmp_path / "a")
    record = json.loads((tmp_path / "a/eval.json").read_text())["rewards"]
    assert record["remote"]["params"]["api_key"] == "<redacted>" and "secret" not in json.dumps(record)
    assert record["remote"]["request"]["temperature"] == 1.0 and record["remote"]["request"]["seed"] == 3
    assert record["pairwise_remote"]["request"]["seed"] == 4 and record["pairwise_remote"]["name"] == "pairwise_remote"
    sent = [b.get("seed") for b in server.bodies]
    assert None not in sent[2:]  # every scoring request carried its seed (after the two start-up checks)
    rates = first["rewards"]["pairwise_remote"][0]  # [3 prompts, 2 samples]: each prompt's two samples compared
    assert rates.shape == (3, 2) and rates.sum(1).tolist() == pytest.approx([1.0] * 3)
    again = evaluate([str(tiny_export)], cfg, tmp_path / "b")
    assert again["rewards"]["remote"][0].equal(first["rewards"]["remote"][0])
    assert sorted(b.get("seed") or 0 for b in server.bodies[len(sent):]) == sorted(s or 0 for s in sent)
    with pytest.raises(ValueError, match=r"^reward_params: 'jpeg' is not one of rewards"):
        EvalConfig(rewards=["jpeg_compressibility"], reward_params={"jpeg": {}}).validate()
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['pairwise_remot'\]"):  # a typo in the name itself
        EvalConfig(rewards=["pairwise_remot"], reward_params={"pairwise_remote": {}}).validate()


def test_eval_config_refuses_bad_sizes_and_a_groupwise_reward_without_groups(server):
    from posttrain.eval.evaluate import EvalConfig, redacted

    with pytest.raises(ValueError, match=r"^batch_size: must be"):
        EvalConfig(batch_size=0).validate()
    params = {"pairwise_remote": {"base_url": server.base_url, "model": "m"}}
    with pytest.raises(ValueError, match=r"^samples_per_prompt: \['pairwise_remote'\] compare"):
        EvalConfig(rewards=["pairwise_remote"], reward_params=params, samples_per_prompt=1).validate()
    EvalConfig(rewards=["pairwise_remote"], reward_params=params, samples_per_prompt=2).validate()
    assert redacted({"api_key": "k", "extra_body": {"headers": [{"token": "t"}]}, "url": "https://u:p@host/v1"}) == {
        "api_key": "<redacted>", "extra_body": {"headers": [{"token": "<redacted>"}]},
        "url": "https://<redacted>@host/v1"}
