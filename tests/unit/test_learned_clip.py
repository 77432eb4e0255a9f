"""learned_clip: the reward loaded back through its own loading code, the contrastive loss, and a
training smoke test through `posttrain train-reward` on a few emoji."""

import json
import math

import pytest
import torch

from rewards.base import build_reward
from rewards.learned_clip import ClipNet, LearnedClipConfig, contrastive_loss, load_learned_clip, save_learned_clip

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    net = ClipNet(LearnedClipConfig(width=8, embed_dim=16))
    return save_learned_clip(net, tmp_path_factory.mktemp("lc") / "model"), net


def test_reward_scores_a_batch(saved):
    folder, net = saved
    reward = build_reward("learned_clip", path=str(folder))
    images = torch.rand(4, 3, 48, 48, generator=torch.Generator().manual_seed(1))  # resized inside to 32
    prompts = ["grinning face", "red apple", "flag: France", "grinning face"]
    r1, r2 = reward(images, prompts), reward(images, prompts)
    assert r1.shape == (4,) and r1.dtype == torch.float32
    assert torch.isfinite(r1).all() and (r1.abs() <= 1 + 1e-6).all()
    assert torch.equal(r1, r2)
    assert all(not p.requires_grad for p in reward.net.parameters())
    assert all(not p.requires_grad for p in reward.text.model.parameters())
    # the score is the cosine of the saved weights' embeddings: recompute it from the original module
    with torch.no_grad():
        txt = net.text_embeds(reward.text(prompts))
        expected = (net.image_embeds(images) * txt).sum(-1)
    torch.testing.assert_close(r1, expected, atol=1e-5, rtol=0)
    logit = build_reward("learned_clip", path=str(folder), logit=True)(images, prompts)
    torch.testing.assert_close(logit, r1 * (1 / 0.07), rtol=1e-4, atol=1e-5)


def test_loading_errors(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_learned_clip(tmp_path)
    folder, _ = saved
    reward = build_reward("learned_clip", path=str(folder))
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(torch.rand(2, 3, 32, 32), ["a"])


def test_contrastive_loss_values():
    eye = torch.eye(4)
    # perfectly aligned, orthogonal pairs: loss = log(1 + 3 exp(-s)) per direction
    s = torch.tensor(2.0)
    assert float(contrastive_loss(eye, eye, s)) == pytest.approx(math.log(1 + 3 * math.exp(-2)), rel=1e-6)
    # identical embeddings everywhere: chance, log(B)
    same = torch.nn.functional.normalize(torch.ones(4, 4), dim=-1)
    assert float(contrastive_loss(same, same, s)) == pytest.approx(math.log(4), rel=1e-5)


def test_train_reward_smoke(tmp_path, capsys):
    """96 train emoji, 25 epochs: the loss halves and train-set retrieval beats chance (1/96)
    by 20x at top-1; the saved folder loads as a reward."""
    from posttrain.cli import main

    out = tmp_path / "rm"
    code = main(["train-reward", "configs/reward/learned_clip_a.yaml", f"out_dir={out}", "data.limit=96",
                 "train.epochs=25", "train.batch_size=32", "train.threads=1", "train.eval_every=25",
                 "model.width=16"])
    assert code == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["loss_last"] < 0.5 * m["loss_first"], m
    assert m["train"]["n"] == 96 and m["train"]["top1"] >= 20 * m["train"]["chance_top1"], m
    assert m["heldout"]["n"] == 12
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 25 and "heldout" in rows[-1]
    r = build_reward("learned_clip", path=str(out / "model"))(torch.rand(2, 3, 32, 32), ["a", "b"])
    assert r.shape == (2,) and torch.isfinite(r).all()
    bank = (out / "model" / "captions.txt").read_text().splitlines()  # the contrastive caption bank
    assert len(bank) == len(set(bank)) and 0 < len(bank) <= 96
    c = build_reward("learned_clip_contrastive", path=str(out / "model"))(torch.rand(2, 3, 32, 32), ["a", "b"])
    assert c.shape == (2,) and (c <= 0).all() and torch.isfinite(c).all()


def test_contrastive_score_is_the_log_softmax_over_prompt_and_bank(saved, tmp_path):
    folder, net = saved
    bank = ["red apple", "flag: France", "kangaroo", "red apple"]  # a duplicate, and the prompt itself
    (tmp_path / "bank.txt").write_text("\n".join(bank) + "\n")
    reward = build_reward("learned_clip_contrastive", path=str(folder), negatives=str(tmp_path / "bank.txt"))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    got = reward(images, ["red apple", "grinning face"])
    with torch.no_grad():
        img = net.image_embeds(images)
        logits = img @ net.text_embeds(reward.text(["red apple", "flag: France", "kangaroo", "grinning face"])).T
        logits = logits * net.scale()
    # "red apple": its classes are {red apple, flag, kangaroo}; "grinning face": itself + all 3 distinct
    want0 = logits[0, 0] - torch.logsumexp(logits[0, :3], 0)
    want1 = logits[1, 3] - torch.logsumexp(logits[1, [3, 0, 1, 2]], 0)
    torch.testing.assert_close(got, torch.stack([want0, want1]), atol=1e-5, rtol=0)
    with pytest.raises(FileNotFoundError, match="caption bank"):
        build_reward("learned_clip_contrastive", path=str(folder))  # no captions.txt in this folder


def test_train_half_splits_disjointly():
    from pretrain.data.dataset import DataConfig, build_datasets
    from pretrain.text_encoder import NoTextEmbeds

    halves = [build_datasets(DataConfig(train_half=h), NoTextEmbeds()) for h in (0, 1)]
    full, held = build_datasets(DataConfig(), NoTextEmbeds())
    a, b = (set(t.captions) for t, _ in halves)
    assert not a & b and a | b == set(full.captions)
    assert 0.4 < len(a) / len(full) < 0.6
    assert halves[0][1].captions == halves[1][1].captions == held.captions


def test_eval_reward_entries_take_a_path():
    from posttrain.eval.evaluate import EvalConfig, parse_eval_reward

    assert parse_eval_reward("learned_clip@runs/x/model") == ("learned_clip", {"path": "runs/x/model"})
    assert parse_eval_reward("jpeg_compressibility") == ("jpeg_compressibility", {})
    EvalConfig(rewards=["learned_clip@runs/x/model", "jpeg_compressibility"]).validate()
    for bad, msg in (["learned_clip@"], "NAME@PATH"), (["learned_clip"], "bad parameters"), (["jpeg_compressibility@x"], "bad parameters"):
        with pytest.raises(ValueError, match=msg):
            EvalConfig(rewards=bad).validate("eval.")


def test_retrieval_score_is_the_rank_of_the_own_prompt(saved, tmp_path):
    folder, _ = saved
    prompts = ["red apple", "green book", "blue heart", "yellow star"]
    torch.manual_seed(0)
    images = torch.rand(4, 3, 32, 32)
    cos = build_reward("learned_clip", path=str(folder))
    sims = torch.stack([cos(images, [p] * 4) for p in prompts], 1)  # [image, candidate]
    rank = (sims > sims.diagonal()[:, None]).sum(1)
    for k in (1, 2, 4):
        got = build_reward("learned_clip_retrieval", path=str(folder), top_k=k)(images, prompts)
        assert got.tolist() == (rank < k).float().tolist()
    assert build_reward("learned_clip_retrieval", path=str(folder), top_k=4)(images, prompts).tolist() == [1.0] * 4
    # extra candidates from a file can only push the own prompt down
    (tmp_path / "c.txt").write_text("\n".join(f"caption {i}" for i in range(20)) + "\n")
    wider = build_reward("learned_clip_retrieval", path=str(folder), top_k=1, candidates=str(tmp_path / "c.txt"))
    assert (wider(images, prompts) <= build_reward("learned_clip_retrieval", path=str(folder), top_k=1)(images, prompts)).all()
    with pytest.raises(ValueError, match="top_k"):
        build_reward("learned_clip_retrieval", path=str(folder), top_k=0)


def test_learned_clip_rewards_share_one_text_encoder(saved):
    folder, _ = saved
    a = build_reward("learned_clip", path=str(folder))
    b = build_reward("learned_clip_retrieval", path=str(folder))
    assert a.text is b.text  # an ensemble of K members loads MiniLM once and encodes each prompt once
