import math

import pytest
import torch

from posttrain.objectives.advantages import group_advantages, per_reward_advantages
from posttrain.eval.evaluate import paired_stats
from posttrain.objectives.ppo import kl_to_reference, ppo_clip_loss
from rewards.base import CompositeReward, weighted_sum
from rewards.jpeg import jpeg_size_kb
from rollout.trajectory import train_timesteps

pytestmark = pytest.mark.core


def test_equal_rewards_give_exactly_zero_advantages():
    adv, valid, zero = group_advantages(torch.tensor([0.3, 0.3, 0.3, 0.3]), torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0] and zero.all() and valid.all()


def test_advantages_closed_form():
    r = torch.tensor([0.0, 0.5, 0.5, 1.0])
    adv, _, zero = group_advantages(r, torch.zeros(4, dtype=torch.long))
    std = math.sqrt(0.125)  # population std = 0.35355
    expected = [(x - 0.5) / (std + 1e-4) for x in r.tolist()]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert not zero.any()


def test_groups_are_separate_and_clipped():
    r = torch.tensor([0.0, 1.0, 10.0, 20.0, 0.0, 0.0, 0.0, 100.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 2, 2])
    adv, _, _ = group_advantages(r, g, adv_clip_max=1.5)
    assert adv[:4].tolist() == pytest.approx([-1, 1, -1, 1], abs=1e-3)
    assert adv[7].item() == 1.5  # (100 - 25) / 43.3 = 1.73 clipped


def test_nan_reward_gets_zero_advantage_and_no_loss():
    r = torch.tensor([0.0, float("nan"), 1.0, 1.0])
    adv, valid, _ = group_advantages(r, torch.zeros(4, dtype=torch.long))
    assert adv[1].item() == 0.0 and valid.tolist() == [True, False, True, True]
    # stats over the three finite values: mean 2/3, std 0.4714
    assert adv[0].item() == pytest.approx(-(2 / 3) / (0.471405 + 1e-4), abs=1e-4)
    log_prob = torch.tensor([0.0, 5.0, 0.0, 0.0], requires_grad=True)
    loss, _ = ppo_clip_loss(log_prob, torch.zeros(4), adv, 0.2, mask=valid)
    loss.backward()
    assert log_prob.grad[1].item() == 0.0 and log_prob.grad[0].item() != 0.0


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.0, 1.5, 0.5]))
    adv = torch.tensor([2.0, 1.0, 1.0])
    loss, stats = ppo_clip_loss(new, old, adv, clip_range=0.2)
    # per sample: max(-A r, -A clip(r)): [-2, max(-1.5, -1.2) = -1.2, max(-0.5, -0.8) = -0.5]
    assert loss.item() == pytest.approx((-2 - 1.2 - 0.5) / 3, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(1.5)


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([1.0, -3.0, 0.5])
    loss, stats = ppo_clip_loss(torch.zeros(3), torch.zeros(3), adv, 1e-4)
    assert loss.item() == pytest.approx(-adv.mean().item()) and stats["approx_kl"] == 0.0


def test_kl_to_reference_by_hand():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    std = torch.tensor([0.5, 2.0])
    # sample 0: mean sq diff (1 + 4)/2 = 2.5, / (2 * 0.25) = 5; sample 1: 0.5 / 8 = 0.0625
    assert kl_to_reference(mean, ref, std).tolist() == pytest.approx([5.0, 0.0625])


@pytest.mark.parametrize("fraction,expected", [(0.6, 6), (1.0, 10), (0.99, 9), (0.05, 1)])
def test_timestep_fraction(fraction, expected):
    assert train_timesteps(10, fraction) == list(range(expected))
    rnd = train_timesteps(10, fraction, "random", torch.Generator().manual_seed(0))
    assert len(rnd) == expected and len(set(rnd)) == expected and max(rnd) < 10


def test_jpeg_reward_prefers_flat_images():
    flat = torch.ones(1, 3, 32, 32)
    noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sizes = jpeg_size_kb(torch.cat([flat, noisy]))
    assert sizes[0] < sizes[1]
    comp = CompositeReward({"jpeg_compressibility": 1.0})
    total, raw = comp(torch.cat([flat, noisy]), ["a", "b"])
    assert torch.equal(total, -sizes) and torch.equal(raw["jpeg_compressibility"], -sizes)


def test_weighted_sum_skips_nan_and_renormalises():
    a = torch.tensor([1.0, float("nan"), float("nan")])
    b = torch.tensor([3.0, 2.0, float("nan")])
    out = weighted_sum({"a": a, "b": b}, {"a": 1.0, "b": 3.0})
    assert out[0].item() == pytest.approx(1.0 + 9.0)
    assert out[1].item() == pytest.approx(2.0 * 3.0 * 4 / 3)  # only b: its weight scaled to the total
    assert math.isnan(out[2].item())


def test_paired_stats_clustered_by_prompt():
    base = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    other = torch.tensor([[2.0, 2.0], [2.0, 4.0], [3.0, 5.0]])
    d, se, p = paired_stats(base, other)
    # per-prompt mean differences [1, 1, 1] -> mean 1, sd 0
    assert (d, se, p) == (1.0, 0.0, 3)
    d, se, _ = paired_stats(base[:, :1], torch.tensor([[2.0], [2.0], [6.0]]))
    # differences [1, 0, 3]: mean 4/3, sd 1.5275, se 0.8819
    assert d == pytest.approx(4 / 3) and se == pytest.approx(1.527525 / math.sqrt(3), abs=1e-5)


def test_per_reward_advantages_are_scale_free_and_skip_nan():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([1.0, 2.0, 3.0, 0.0, 5.0, 1.0])
    b = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, float("nan")])
    w = {"a": 1.0, "b": 0.5}
    adv, valid, zero = per_reward_advantages({"a": a, "b": b}, w, groups)
    ga, gb = group_advantages(a, groups)[0], group_advantages(b, groups)[0]
    # group 0: both rewards present -> (1 * A_a + 0.5 * A_b) * 1.5 / 1.5; group 1: b has zero spread among its
    # finite values (advantage 0 but valid), sample 5 has no b -> only a, renormalised to the full weight
    torch.testing.assert_close(adv[:3], ga[:3] * 1.0 + gb[:3] * 0.5)
    torch.testing.assert_close(adv[3:5], ga[3:5] * 1.0)
    torch.testing.assert_close(adv[5], ga[5] * 1.5)
    assert valid.all() and not zero.any()
    scaled, _, _ = per_reward_advantages({"a": a * 1000.0, "b": b}, w, groups)
    torch.testing.assert_close(scaled, adv, atol=1e-3, rtol=0)  # scale-free up to the 1e-4 in (std + 1e-4)
    summed = group_advantages(weighted_sum({"a": a * 1000.0, "b": b}, w), groups)[0]
    assert (summed - adv).abs().max() > 0.1  # unlike the weighted sum before advantages


def test_best_of_n_keeps_the_best_and_worst_k_of_each_group():
    from posttrain.grpo.parts.registry import SELECTIONS

    sel = SELECTIONS.build({"name": "best_of_n", "k": 1}, "grpo.selection")
    total = torch.tensor([0.3, 0.9, 0.1, 0.5, float("nan"), 2.0, 1.0, 1.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.isfinite(total)
    zero = torch.zeros(8, dtype=torch.bool)
    mask = sel(total, torch.zeros(8), valid, zero, groups)
    # group 0: best 0.9 (1), worst 0.1 (2); group 1: NaN never trained, best 2.0 (5), worst 1.0 (6)
    assert mask.tolist() == [False, True, True, False, False, True, True, False]
    wide = SELECTIONS.build({"name": "best_of_n", "k": 2}, "grpo.selection")(total, torch.zeros(8), valid, zero, groups)
    assert wide.tolist() == [True, True, True, True, False, True, True, True]  # 2k >= group: all valid kept
    dropped = SELECTIONS.build({"name": "best_of_n", "drop_zero_spread_groups": True}, "grpo.selection")(
        total, torch.zeros(8), valid, groups == 1, groups)
    assert dropped.tolist() == [False, True, True, False, False, False, False, False]


@pytest.mark.parametrize("step", ["sde", "cps", "ddim"])
def test_the_kl_uses_the_std_the_noise_is_drawn_with(step):
    """The policy loss's KL is the exact per-element KL of the two Gaussian transitions: the std is the
    step's own noise std (std_dev_t * sqrt(|dt|) for the SDE), the one its log-prob uses."""
    from posttrain.grpo.parts.ppo_clip_kl import PPOClipKL
    from rollout.steps import get_step

    g = torch.Generator().manual_seed(0)
    x, v, v_ref, z = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(4))
    fn = get_step(step)
    new = fn(x, v, 0.6, 0.5, noise_level=0.7, sigma_after_one=0.9, noise=z)
    ref = fn(x, v_ref, 0.6, 0.5, noise_level=0.7, sigma_after_one=0.9, prev_sample=new.prev_sample)
    loss, stats = PPOClipKL(PPOClipKL.Config(beta=1.0))(new, new.log_prob, torch.zeros(2), torch.ones(2, dtype=torch.bool), ref)
    std = new.step_std
    assert std.min() > 0 and torch.equal(new.prev_sample, new.mean + std.view(-1, 1, 1, 1) * z)
    exact = torch.distributions.kl_divergence(torch.distributions.Normal(new.mean, std.view(-1, 1, 1, 1)),
                                              torch.distributions.Normal(ref.mean, std.view(-1, 1, 1, 1)))
    assert stats["kl"] == pytest.approx(float(exact.flatten(1).mean(1).mean()), rel=1e-5)
    assert float(loss) == pytest.approx(stats["kl"], rel=1e-6)
