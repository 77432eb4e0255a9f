"""learned_judge, the stand-in for the shapes judge: loaded back through its own code, differentiable in
the image, refused for another format, and trained by `posttrain train-reward` (objective: judge) to agree
with the exact judge on held-out prompts it never saw."""

import json

import pytest
import torch

from rewards.base import build_reward
from rewards.learned_clip import ClipNet, LearnedClipConfig, save_learned_clip
from rewards.learned_judge import JudgeNet, load_learned_judge, save_learned_judge

pytestmark = pytest.mark.core


def test_score_is_the_saved_sigmoid_and_differentiable_in_the_image(tmp_path):
    torch.manual_seed(0)
    net = JudgeNet(LearnedClipConfig(width=8, embed_dim=16))
    with torch.no_grad():
        net.bias.fill_(-0.3)
    reward = build_reward("learned_judge", path=str(save_learned_judge(net, tmp_path / "m")))
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    prompts = ["a red circle", "two blue squares", "a triangle"]
    score = reward(images, prompts)
    with torch.no_grad():
        expected = torch.sigmoid(net.logits(images, reward.text(prompts)))
    torch.testing.assert_close(score, expected, atol=1e-6, rtol=0)
    assert score.dtype == torch.float32 and ((score > 0) & (score < 1)).all()
    x = images.clone().requires_grad_(True)
    reward.score(x, prompts).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0  # a reward-gradient method can use it
    assert all(not p.requires_grad for p in reward.net.parameters())


def test_a_learned_clip_folder_is_refused_naming_the_format(tmp_path):
    save_learned_clip(ClipNet(LearnedClipConfig(width=8, embed_dim=16)), tmp_path / "clip")
    with pytest.raises(ValueError, match="learned_judge/1"):
        load_learned_judge(tmp_path / "clip")
    with pytest.raises(FileNotFoundError, match="learned_judge"):
        load_learned_judge(tmp_path / "nothing")


@pytest.mark.long  # make test trains a stand-in from a saved one below
def test_train_reward_judge_objective_learns_the_judge(tmp_path, tiny_export):
    from posttrain.cli import main

    out = tmp_path / "judge"
    code = main(["train-reward", "configs/reward/shapes_judge.yaml", f"out_dir={out}", "data.scenes=512",
                 f"judge.generated_from={tiny_export}", "judge.generated=64", "judge.heldout_generated=32",
                 "judge.num_inference_steps=4", "train.epochs=8", "train.batch_size=64", "train.eval_every=4",
                 "model.width=16"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    # held-out renders (half the prompts novel compositions) with their own and with another caption: the
    # judge's scores spread over [0, 1]; the stand-in tracks them on renders it never saw
    held = metrics["heldout_renders"]
    assert held["n"] == 2 * 192 and held["pearson"] > 0.3, held  # SE of r near 0 here: 0.05
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["heldout_generated"]["n"] == 32
    order = metrics["contrast_order"]
    assert set(order) == {"heldout_renders", "heldout_generated"} and order["heldout_renders"]["pairs"] > 1000
    assert 0.0 <= order["heldout_renders"]["shape"] <= 1.0
    reward = build_reward("learned_judge", path=metrics["model"])
    assert reward(torch.ones(1, 3, 32, 32), ["a red circle"]).shape == (1,)


def test_a_refreshed_stand_in_starts_from_the_folder_it_names(tmp_path):
    """``judge.init_from``: training starts from the saved weights (one epoch at a vanishing learning rate
    leaves the scores as they were, to 1e-5), and a folder of another architecture is refused by name."""
    from posttrain.tools.train_reward import TrainRewardConfig
    from pretrain.config import ConfigError, load_config
    from posttrain.tools.train_judge import train_judge

    def config(*overrides):
        return load_config(TrainRewardConfig, "configs/reward/shapes_judge.yaml",
                           [f"out_dir={tmp_path / 'out'}", "data.scenes=256", "judge.generated_from=null",
                            "train.epochs=1", "train.lr=1e-12", "train.eval_every=1", *overrides])

    cfg = config()
    torch.manual_seed(3)
    source = save_learned_judge(JudgeNet(cfg.model), tmp_path / "source")
    metrics = train_judge(config(f"judge.init_from={source}"))
    before = build_reward("learned_judge", path=str(source))
    after = build_reward("learned_judge", path=metrics["model"])
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    prompts = ["a red circle", "two blue squares", "a triangle", "a green square above a red circle"]
    torch.testing.assert_close(after(images, prompts), before(images, prompts), atol=1e-5, rtol=0)
    with pytest.raises((ValueError, ConfigError), match="judge.init_from"):
        train_judge(config(f"judge.init_from={source}", "model.width=16"))
