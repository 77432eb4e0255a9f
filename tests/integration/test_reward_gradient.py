"""`posttrain reward_gradient` on the tiny export with a differentiable learned reward (a random
learned_judge, saved and loaded through its own code): every method trains and raises the reward it
back-propagates, gradient checkpointing changes no number, and a non-differentiable reward is refused."""

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.runtime.metrics import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    from rewards.learned_clip import LearnedClipConfig
    from rewards.learned_judge import JudgeNet, save_learned_judge

    torch.manual_seed(0)
    return str(save_learned_judge(JudgeNet(LearnedClipConfig(image_size=16, width=8, embed_dim=16)),
                                  tmp_path_factory.mktemp("judge") / "m"))


def config(run_dir, export, judge, *overrides):
    from posttrain.reward_gradient.stage import RewardGradientConfig

    return load_config(RewardGradientConfig, ROOT / "configs/reward_gradient/emoji_tiny.yaml",
                       [f"run_dir={run_dir}", f"model.pretrained={export}", "~reward",
                        f"reward.learned_judge.path={judge}", *overrides])


def test_the_differentiable_path_scores_what_the_reward_scores(judge):
    from rewards.base import build_reward, differentiable_reward
    from rewards.specs import RewardSpec

    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    prompts = ["a cat", "a red circle", "two dogs", "a flag"]
    score = differentiable_reward(RewardSpec("learned_judge", 1.0, {"path": judge}))
    x = images.clone().requires_grad_(True)
    with_grad = score(x, prompts)
    with_grad.sum().backward()
    assert (with_grad.detach() - build_reward("learned_judge", path=judge)(images, prompts)).abs().max() <= 1e-6
    assert x.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="reward.jpeg_compressibility: not a differentiable reward"):
        differentiable_reward(RewardSpec("jpeg_compressibility", 1.0, {}))


@pytest.mark.parametrize("method", ["draft_k", "draft_lv", "refl", "alignprop"])
def test_each_method_raises_the_reward_it_backpropagates(method, tiny_export, judge, tmp_path, capsys):
    from posttrain.reward_gradient.stage import train

    train(config(tmp_path, tiny_export, judge, f"method.name={method}", "method.k=3", "train.steps=6",
                 "optim.lr=1e-2"))
    rows = read_metrics(tmp_path / "reward_gradient" / "metrics.jsonl")
    held = [r["heldout_reward"] for r in rows if "heldout_reward" in r]
    train_reward = [r["reward"] for r in rows if "reward" in r]
    with capsys.disabled():
        print(f"\n{method}: held-out reward {held[0]:.4f} -> {held[-1]:.4f}; training reward "
              f"{train_reward[0]:.4f} -> {train_reward[-1]:.4f}")
    assert len(train_reward) == 6 and held[-1] > held[0] and train_reward[-1] > train_reward[0]
    assert (tmp_path / "reward_gradient" / "export").is_dir() and (tmp_path / "reward_gradient" / "lora").is_dir()


def test_gradient_checkpointing_changes_no_number(tiny_export, judge, tmp_path):
    from posttrain.reward_gradient.stage import train
    from safetensors.torch import load_file

    out = {}
    for flag in (False, True):
        train(config(tmp_path / str(flag), tiny_export, judge, "method.k=4", f"method.checkpoint={flag}",
                     "train.steps=2"))
        run = tmp_path / str(flag) / "reward_gradient"
        out[flag] = ([r["reward"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r],
                     load_file(str(next((run / "lora").rglob("*.safetensors")))))
    assert out[False][0] == out[True][0]
    assert all(torch.equal(out[False][1][k], out[True][1][k]) for k in out[False][1])


def test_a_reward_without_gradient_is_refused_at_start(tiny_export, tmp_path):
    from posttrain.reward_gradient.stage import RewardGradientConfig, RewardGradientRun

    shipped = ROOT / "configs/reward_gradient/emoji_tiny.yaml"
    with pytest.raises(ValueError, match="not a differentiable reward"):
        RewardGradientRun(load_config(RewardGradientConfig, shipped, [f"run_dir={tmp_path}",
                                                                      f"model.pretrained={tiny_export}", "~reward",
                                                                      "reward.jpeg_compressibility={}"]))
    with pytest.raises(ConfigError, match="reward: exactly one differentiable reward"):
        load_config(RewardGradientConfig, shipped, ["~reward"])


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_adjoint_matching_starts_at_zero_control_and_reads_the_start(tiny_export, judge, tmp_path, lora_rank):
    """Before any update the policy is the start (LoRA: B = 0; full: the frozen copy equals it), so the
    control u = 2 (v_ft - v_base) / sigma is 0: with reward_scale 0 the loss is exactly 0, with a reward
    it is mean sigma^2 |a|^2 > 0 and its gradient reaches the trained weights."""
    from posttrain.objectives.adjoint_matching import adjoint_matching
    from posttrain.reward_gradient.stage import RewardGradientRun

    run = RewardGradientRun(config(tmp_path / str(lora_rank), tiny_export, judge, "method.name=adjoint_matching",
                                   f"policy.lora_rank={lora_rank}"))
    chain = run.chain(run.st.model, list(range(4)), 0)
    x, s = chain.noise, chain.sigmas[2].expand(4)
    with torch.no_grad():
        assert torch.equal(chain.velocity(x, s), chain.base_velocity(x, s))
    zero, _ = adjoint_matching(chain, 3, 0.0, torch.Generator().manual_seed(0))
    assert zero.item() == 0.0
    loss, _ = adjoint_matching(chain, 3, 10.0, torch.Generator().manual_seed(0))
    loss.backward()
    grads = [p.grad for p in run.st.model.parameters() if p.requires_grad and p.grad is not None]
    assert loss.item() > 0 and grads and sum(float(g.abs().sum()) for g in grads) > 0


def test_the_data_loss_is_the_flow_matching_loss_of_the_prompts_own_images(tiny_export, judge, tmp_path):
    """``data_loss`` (ReFL's pre-training loss) of a step is the export's rectified-flow loss on the train
    images of the very prompts the step samples, at the per-sample draws of (seed, "data_loss", step, index),
    without prompt dropout, and a step logs it."""
    from posttrain.reward_gradient.stage import RewardGradientRun
    from pretrain.flow import flow_matching_loss, interpolate
    from pretrain.seeding import generator_for
    from pretrain.schedule import sample_training_sigmas

    run = RewardGradientRun(config(tmp_path, tiny_export, judge, "data_loss.weight=0.5", "train.batch_size=4"))
    st, idx = run.st, [3, 0, 5, 1]
    images, embeds, _ = st.train_set.batch(idx)
    x0 = st.codec.encode(images)
    gens = [generator_for(0, "data_loss", 0, i) for i in range(4)]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
    sigma = sample_training_sigmas(gens, 0.0, 1.0, 1.0)
    with torch.no_grad():
        want = flow_matching_loss(st.model(interpolate(x0, noise, sigma), sigma, embeds), x0, noise).mean()
        got = run.data_loss(st.model, idx, 0)
    assert abs(got.item() - want.item()) <= 1e-6 * max(1.0, want.item()) and want.item() > 0
    metrics = run.train_step()
    assert metrics["data_loss"] > 0
