"""Prompt truncation is counted and announced, not silent.

Every text model here cuts prompts at a token limit, so two prompts that agree up to it get the same
embedding and score. On tiny random models (no downloads) and the bundled MiniLM: two such prompts
score identically, the counter reports 1.0 for two long prompts and 0.5 for one long and one short,
and one warning per process names the model, its limit and the prompt.
"""

import logging
import math
import re

import pytest
import torch

from pretrain import truncation
from rewards.base import CompositeReward, build_reward
from pretrain.truncation import TruncationCounter, fractions, hf_token_counts, take_truncation_counts
from tests.unit.tiny_reward_models import bert_tokenizer_dir, sample_images, save_tiny_clip, tiny_clip_tokenizer

pytestmark = pytest.mark.core

PHRASE = "a watercolor painting of a small red fox sitting in a snowy birch forest at dawn"
BASE = ", ".join([PHRASE] * 6)  # > 77 tokens for every tokenizer here
LONG_A, LONG_B = BASE + ", wearing a green scarf", BASE + ", chasing a blue butterfly"
SHORT = "a red apple"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a new process would: nothing warned about yet."""
    monkeypatch.setattr(truncation, "_WARNED", set())


def warnings_about(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pretrain.truncation" and r.getMessage().startswith(f"{name} truncates")]


def check_counts_and_one_warning(call, counter: TruncationCounter, name: str, limit: int, caplog) -> None:
    """``call(prompts)`` runs the model on 2 prompts; its counter says 1.0, 0.5, 0.0 for 2, 1, 0 long
    prompts, and one warning (naming ``name``, ``limit`` and the first long prompt) is logged in all."""
    caplog.set_level(logging.WARNING, logger="pretrain.truncation")
    assert counter.name == name and counter.limit == limit
    for _ in range(2):
        call([LONG_A, LONG_B])
        assert counter.last_fraction == 1.0
        call([LONG_A, SHORT])
        assert counter.last_fraction == 0.5
        call([SHORT, "a cat"])
        assert counter.last_fraction == 0.0
    msgs = warnings_about(caplog, name)
    assert len(msgs) == 1, msgs
    assert f"{name} truncates prompts at {limit} tokens" in msgs[0]
    assert re.search(r"\b(1 of 1|2 of 2) prompts", msgs[0]) and f"'{PHRASE[:40]}" in msgs[0] and "...'" in msgs[0]


def same_image_twice() -> torch.Tensor:
    return sample_images(1).repeat(2, 1, 1, 1)


def check_reward(reward, name: str, limit: int, caplog) -> None:
    """Each long prompt, longer than ``limit``, scores the same on one image (what the count reports);
    two short prompts do not; then :func:`check_counts_and_one_warning`."""
    one = sample_images(1)
    assert torch.equal(reward(one, [LONG_A]), reward(one, [LONG_B]))  # they agree up to the limit
    assert reward.truncation.last_fraction == 1.0
    assert not torch.equal(reward(one, ["a red apple"]), reward(one, ["a blue car"]))
    assert reward.truncation.last_fraction == 0.0
    x = same_image_twice()
    check_counts_and_one_warning(lambda p: reward(x, p), reward.truncation, name, limit, caplog)


# ---- the policy's text encoders ----

def test_minilm_text_encoder_counts_truncated_prompts(minilm, caplog):
    assert min(hf_token_counts(minilm.tokenizer, [LONG_A, LONG_B])) > 24
    e = minilm.encode([LONG_A, LONG_B])
    assert torch.equal(e.tokens[0], e.tokens[1]) and torch.equal(e.pooled[0], e.pooled[1])
    check_counts_and_one_warning(minilm.encode, minilm.truncation, "text_encoder.minilm", 24, caplog)
    assert minilm.check_truncation([LONG_A, SHORT, SHORT, SHORT]) == 0.25  # counting without encoding
    assert minilm.truncation.last_fraction == 0.25


def test_clip_folder_text_encoder_counts_truncated_prompts(tmp_path, caplog):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from pretrain.text_encoder import CLIPFolderEncoder

    tok = tiny_clip_tokenizer()
    torch.manual_seed(0)
    CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=8, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )).save_pretrained(tmp_path / "text_encoder")
    tok.save_pretrained(tmp_path / "tokenizer")
    enc = CLIPFolderEncoder(str(tmp_path))
    e = enc.encode([LONG_A, LONG_B])
    assert torch.equal(e.pooled[0], e.pooled[1])
    check_counts_and_one_warning(enc.encode, enc.truncation, "text_encoder.clip_folder", 77, caplog)


# ---- rewards ----

@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip") / "clip", logit_scale=2.0)


@pytest.fixture(scope="module")
def learned_clip_dir(tmp_path_factory):
    from rewards.learned_clip import ClipNet, LearnedClipConfig, save_learned_clip

    torch.manual_seed(0)
    return save_learned_clip(ClipNet(LearnedClipConfig(width=8, embed_dim=16)), tmp_path_factory.mktemp("lc") / "m")


def test_clip_score_counts_truncated_prompts(clip_dir, caplog):
    check_reward(build_reward("clip_score", path=str(clip_dir)), "clip_score", 77, caplog)


def test_pickscore_counts_truncated_prompts(clip_dir, caplog):
    check_reward(build_reward("pickscore", path=str(clip_dir)), "pickscore", 77, caplog)


def test_hpsv2_counts_truncated_prompts(tmp_path, caplog):
    import json

    import open_clip

    from tests.unit.test_rewards_hpsv2 import TINY

    cfg = tmp_path / "tiny-hps-trunc.json"
    cfg.write_text(json.dumps(TINY))
    open_clip.add_model_config(cfg)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps-trunc")
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2_compressed.pt")
    reward = build_reward("hpsv2", checkpoint=str(tmp_path / "HPS_v2_compressed.pt"), model_config=str(cfg))
    check_reward(reward, "hpsv2", 77, caplog)


def test_imagereward_counts_truncated_prompts(tmp_path, caplog):
    import json

    from tests.unit.test_rewards_imagereward import MED, VISION, save_checkpoint, tiny_parts

    (tmp_path / "med_config.json").write_text(json.dumps(MED))
    ckpt = save_checkpoint(tmp_path / "ImageReward.pt", *tiny_parts())
    reward = build_reward("imagereward", checkpoint=ckpt, tokenizer_path=bert_tokenizer_dir(),
                          med_config=str(tmp_path / "med_config.json"), vision_config=VISION)
    check_reward(reward, "imagereward", 35, caplog)


def test_learned_clip_counts_truncated_prompts(learned_clip_dir, caplog):
    reward = build_reward("learned_clip", path=str(learned_clip_dir))
    check_reward(reward, "learned_clip", 32, caplog)
    retrieval = build_reward("learned_clip_retrieval", path=str(learned_clip_dir))
    retrieval(same_image_twice(), [LONG_A, SHORT])
    assert retrieval.truncation.name == "learned_clip_retrieval" and retrieval.truncation.last_fraction == 0.5


def test_counts_per_iteration_for_the_trainer(learned_clip_dir, clip_dir):
    """A composite with a wrapped reward: counts since the last take, per config name, rewards that
    read no prompt left out."""
    member = {"name": "learned_clip", "path": str(learned_clip_dir)}
    comp = CompositeReward({"jpeg_compressibility": 1.0, "clip_score": {"weight": 1.0, "path": str(clip_dir)},
                            "ensemble": {"weight": 1.0, "members": [member, dict(member)]}})
    x = same_image_twice()
    comp(x, [LONG_A, SHORT])
    comp(x, [LONG_A, LONG_B])
    counts = take_truncation_counts(comp.models)
    assert counts == {"clip_score": (3, 4), "ensemble": (6, 8)}  # two members, two batches of 2 each
    assert fractions(counts) == {"clip_score": 0.75, "ensemble": 0.75}
    assert take_truncation_counts(comp.models) == {"clip_score": (0, 0), "ensemble": (0, 0)}
    assert all(math.isnan(f) for f in fractions(take_truncation_counts(comp.models)).values())  # nothing seen
    assert comp.models["clip_score"].truncation.total_truncated == 3


def test_counter_checks_its_input(caplog):
    caplog.set_level(logging.WARNING, logger="pretrain.truncation")
    c = TruncationCounter("toy", 4)
    assert math.isnan(c.last_fraction)  # before any call
    assert c.check(["a b c", "a b c d e f"], [5, 8]) == 1.0
    assert math.isnan(c.check([], [])) and math.isnan(c.last_fraction)  # no prompts
    assert math.isnan(c.check(["x"], None)) and c.last_total == 0  # not countable: nothing recorded
    with pytest.raises(ValueError, match="2 token counts for 1 prompts"):
        c.check(["x"], [1, 2])
    with pytest.raises(ValueError, match=r"not in \[0, 2\]"):
        c.record(3, 2)
    assert len(warnings_about(caplog, "toy")) == 1
