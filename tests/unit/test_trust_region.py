"""Flow-DPPO's divergence mask and GRPO-Guard's normalised ratio in closed form
(posttrain/objectives/trust_region.py)."""

import math

import pytest
import torch

from posttrain.objectives.trust_region import divergence_masked_loss, guarded_clip_loss, normalized_log_ratio

pytestmark = pytest.mark.core


def _log_prob(x, mean, std):
    """Per-element-mean Gaussian log-density, Flow-GRPO's scale (rollout/sde.py's)."""
    s = std.view(-1, *[1] * (x.dim() - 1))
    return (-(x - mean).square() / (2 * s.square()) - torch.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def test_divergence_mask_by_hand():
    # 4 rows, one element each, step_std 1: KL = (mean - old)^2 / 2
    old_mean = torch.zeros(4, 1)
    mean = torch.tensor([[0.001], [1.0], [1.0], [1.0]], requires_grad=True)  # KL 5e-7, then 0.5 three times
    std = torch.ones(4)
    x = torch.tensor([[0.5], [0.5], [0.5], [2.0]])  # r > 1 where x is nearer the new mean
    lp, old_lp = _log_prob(x, mean, std), _log_prob(x, old_mean, std)
    ratio = torch.exp(lp - old_lp).detach()
    assert ratio[0] > 1 and ratio[1] == pytest.approx(1.0) and ratio[3] > 1
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = divergence_masked_loss(lp, old_lp, mean, old_mean, std, adv, kl_threshold=1e-6)
    # row 0: KL below the threshold -> kept; row 1: ratio exactly 1 at x = 0.5 (neither side) -> kept;
    # row 2: ratio 1 too; row 3: far, ratio > 1 with A < 0 (pulling back) -> kept. Now move row 2 out:
    assert stats["masked_frac"] == 0.0
    x2 = x.clone()
    x2[2] = 2.0  # row 2: far, r > 1, A > 0 -> blocked
    lp2, old2 = _log_prob(x2, mean, std), _log_prob(x2, old_mean, std)
    loss2, stats2 = divergence_masked_loss(lp2, old2, mean, old_mean, std, adv, kl_threshold=1e-6)
    assert stats2["masked_frac"] == 0.25 and stats2["kl_old_max"] == pytest.approx(0.5)
    loss2.backward()
    assert mean.grad[2].item() == 0.0 and mean.grad[0].item() != 0.0 and mean.grad[3].item() != 0.0
    r2 = torch.exp(lp2 - old2).detach()
    expected = (-(adv * r2))[[0, 1, 3]].sum() / 4  # the blocked row counts in the mean as a 0
    assert loss2.item() == pytest.approx(expected.item(), rel=1e-6)
    # the same blocked row under a looser threshold passes
    assert divergence_masked_loss(lp2, old2, mean, old_mean, std, adv, kl_threshold=1.0)[1]["masked_frac"] == 0.0
    # the other side: far, r < 1 (x nearer the old mean) with A < 0 -> blocked; with A > 0 (pulling back) kept
    x3 = torch.tensor([[-1.0]])
    lp3, old3 = _log_prob(x3, mean[1:2], std[:1]), _log_prob(x3, old_mean[:1], std[:1])
    assert torch.exp(lp3 - old3).item() < 1
    m = mean[1:2]
    for a, blocked in ((-1.0, 1.0), (1.0, 0.0)):
        _, st3 = divergence_masked_loss(lp3, old3, m, old_mean[:1], std[:1], torch.tensor([a]), kl_threshold=1e-6)
        assert st3["masked_frac"] == blocked


def test_normalized_ratio_is_noise_times_mean_shift_and_one_without_a_shift():
    g = torch.Generator().manual_seed(0)
    old_mean = torch.randn(6, 3, 4, 4, generator=g)
    shift = 0.05 * torch.randn(6, 3, 4, 4, generator=g)
    std = torch.tensor([0.3, 0.1, 0.03, 0.3, 0.1, 0.03])
    eps = torch.randn(6, 3, 4, 4, generator=g)
    x = old_mean + std.view(-1, 1, 1, 1) * eps
    z = normalized_log_ratio(_log_prob(x, old_mean + shift, std), _log_prob(x, old_mean, std), old_mean + shift,
                             old_mean, std)
    assert z.tolist() == pytest.approx((eps * shift).flatten(1).mean(1).tolist(), abs=1e-5)
    same = normalized_log_ratio(_log_prob(x, old_mean, std), _log_prob(x, old_mean, std), old_mean, old_mean, std)
    assert torch.equal(same, torch.zeros(6))  # ratio exactly 1 before any update
    raw = (_log_prob(x, old_mean + shift, std) - _log_prob(x, old_mean, std))
    b = (shift.square().flatten(1).mean(1) / (2 * std.square()))
    assert raw.tolist() == pytest.approx((z / std - b).tolist(), abs=1e-4)  # the raw log-ratio sits at -b on average


def test_guarded_clip_weights_rows_by_inverse_dt():
    mean = torch.zeros(2, 1, requires_grad=True)
    step_std, std_dev_t = torch.tensor([0.5, 0.1]), torch.tensor([1.0, 1.0])  # |dt| = 0.25 and 0.01
    lp = torch.zeros(2)
    adv = torch.tensor([1.0, 2.0])
    zero = torch.zeros(2, 1)
    loss, stats = guarded_clip_loss(lp, lp.detach(), mean, zero, step_std, std_dev_t, advantages=adv, clip_range=1e-3)
    # ratio 1 everywhere: per-row loss -A, weights 4 and 100, mean over 2 rows
    assert stats["ratio_mean"] == 1.0 and stats["step_weight_mean"] == pytest.approx(52.0)
    assert loss.item() == pytest.approx((-1.0 * 4 - 2.0 * 100) / 2)
    flat, _ = guarded_clip_loss(lp, lp.detach(), mean, zero, step_std, std_dev_t, advantages=adv, clip_range=1e-3,
                                reweight=False)
    assert flat.item() == pytest.approx(-1.5)
    # clipping on the normalised ratio: a row whose normalised log-ratio is 0.01 > clip 1e-3 with A > 0 is clipped
    old = torch.zeros(1, 1)
    new_mean = torch.full((1, 1), 0.02, requires_grad=True)
    x = torch.full((1, 1), 0.5)  # eps = 0.5 / 1: normalised log-ratio = eps * shift = 0.01
    one = torch.ones(1)
    lp_new, lp_old = _log_prob(x, new_mean, one), _log_prob(x, old, one)
    clipped, st = guarded_clip_loss(lp_new, lp_old, new_mean, old, one, one, advantages=one, clip_range=1e-3,
                                    reweight=False)
    assert st["clip_frac"] == 1.0 and clipped.item() == pytest.approx(-(1 + 1e-3))
    clipped.backward()
    assert new_mean.grad.abs().item() == 0.0  # past the clip, no gradient
