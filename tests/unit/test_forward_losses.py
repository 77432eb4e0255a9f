"""Closed forms of the forward-process losses (DiffusionNFT, AWM, DGPO) and the ``ode`` step."""

import math

import pytest
import torch

from posttrain.objectives.forward_losses import awm_loss, dgpo_loss, nft_loss, nft_optimality
from pretrain.flow import euler_step, flow_matching_loss, interpolate
from pretrain.objective import pretrain_loss
from pretrain.text_encoder import PromptEmbeds
from rollout.ode import ode_step

pytestmark = pytest.mark.core


def test_nft_loss_and_gradient_by_hand():
    # x0 = 0, x_t = (0.5, 0.5), sigma 0.5, v = (1, 1), v_old = (0, 2), beta 0.5, r 0.75, m 5:
    # v+ = (0.5, 1.5): x0+ - x0 = (0.25, -0.25), weight 0.25, L+ = 0.0625 / 0.25 = 0.25;
    # v- = (-0.5, 2.5): x0- - x0 = (0.75, -0.75), weight 0.75, L- = 0.5625 / 0.75 = 0.75;
    # loss = 5 (0.75 * 0.25 + 0.25 * 0.75) / 0.5 = 3.75.
    # dL+/dv = beta * (-sigma) * 2 err+ / (D w+) = 0.5 * (-0.5) * (1, -1) = (-0.25, 0.25); dL-/dv = (0.25, -0.25);
    # dloss/dv = 10 (0.75 (-0.25, 0.25) + 0.25 (0.25, -0.25)) = (-1.25, 1.25).
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss = nft_loss(v, torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2), torch.tensor([[0.5, 0.5]]),
                    torch.tensor([0.5]), torch.tensor([0.75]), beta=0.5, adv_clip_max=5.0)
    torch.testing.assert_close(loss, torch.tensor([3.75]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-1.25, 1.25]]))


def test_nft_optimality_maps_advantages_to_probabilities():
    r = nft_optimality(torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0]), adv_clip_max=5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))


def test_nft_gradient_is_zero_at_the_old_policy_with_r_one_half():
    g = torch.Generator().manual_seed(0)
    v_old = torch.randn(3, 4, 5, 5, generator=g)
    v = v_old.clone().requires_grad_(True)
    x0, x_t = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    loss = nft_loss(v, v_old, x0, x_t, torch.tensor([0.2, 0.5, 0.9]), torch.full((3,), 0.5), beta=1.0,
                    adv_clip_max=5.0)
    loss.sum().backward()
    assert v.grad.abs().max() < 1e-6


def test_awm_with_unit_advantages_is_the_flow_matching_loss_bitwise():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(6, 6)

    def model(x, sigma, embeds):  # a velocity model of the pretraining call signature
        return lin(x.flatten(1) + embeds.pooled[:, :6]).view_as(x) * sigma[:, None, None, None]

    x0, noise = torch.randn(4, 1, 2, 3, generator=g), torch.randn(4, 1, 2, 3, generator=g)
    sigma = torch.rand(4, generator=g)
    embeds = PromptEmbeds(torch.randn(4, 3, 8, generator=g), torch.randn(4, 8, generator=g))
    null = PromptEmbeds(torch.zeros(1, 3, 8), torch.zeros(1, 8))
    want = pretrain_loss(model, x0, embeds, null, noise, sigma, torch.zeros(4, dtype=torch.bool))
    v = model(interpolate(x0, noise, sigma), sigma, embeds)
    got = awm_loss(v, x0, noise, torch.ones(4), torch.ones(4, dtype=torch.bool))
    assert torch.equal(got, want)


def test_awm_with_zero_advantages_has_zero_gradient():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    loss = awm_loss(v, torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g), torch.zeros(3),
                    torch.ones(3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(v.grad) == 0


def test_awm_weights_each_sample_by_its_advantage_over_the_mask():
    v, x0, noise = torch.zeros(3, 1, 1, 2), torch.zeros(3, 1, 1, 2), torch.tensor([1.0, 2.0, 3.0])[:, None, None, None].expand(3, 1, 1, 2)
    # per-sample flow-matching loss = (0 - noise)^2 = 1, 4, 9; sample 2 is masked: (2 * 1 + -1 * 4) / 2 = -1
    got = awm_loss(v, x0, noise, torch.tensor([2.0, -1.0, 7.0]), torch.tensor([True, True, False]))
    assert float(got) == -1.0


def test_dgpo_by_hand():
    # beta 2, groups of 2 with A = (1, -1): group 0 diffs (-0.5, 0.5) -> s = (2 / 2)(-0.5 - 0.5) = -1,
    # loss -log sigmoid(1); group 1 diffs (0.2, 0.1) -> s = 0.1, loss -log sigmoid(-0.1).
    err = torch.tensor([0.5, 1.5, 1.2, 1.1], requires_grad=True)
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0])
    adv, groups = torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([0, 0, 1, 1])
    loss, stats = dgpo_loss(err, ref, adv, groups, beta=2.0)
    want = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.1))) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    # d/de_i = sigmoid(s_g) (beta / G) A_i / (number of groups)
    s0, s1 = 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-0.1))
    torch.testing.assert_close(err.grad, torch.tensor([s0, -s0, s1, -s1]) / 2)
    assert stats["implicit_acc"] == 0.5


def test_dgpo_is_ln2_when_the_policy_is_the_reference():
    err = torch.rand(8) + 0.5
    loss, _ = dgpo_loss(err, err.clone(), torch.randn(8), torch.arange(8) // 4, beta=100.0)
    assert float(loss) == pytest.approx(math.log(2.0), abs=1e-7)


def test_flow_matching_errors_of_dgpo_come_from_the_pretraining_loss():
    x0, noise, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(flow_matching_loss(v, x0, noise), (v - (noise - x0)).square().mean((1, 2, 3)))


def test_the_ode_step_is_the_euler_step_with_no_log_prob():
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    out = ode_step(x, v, torch.tensor(0.8), torch.tensor(0.6), noise_level=0.7, noise=torch.randn(3, 2, 4, 4))
    assert torch.equal(out.prev_sample, euler_step(x, v, torch.tensor(0.8), torch.tensor(0.6)))
    assert torch.count_nonzero(out.log_prob) == 0 and torch.count_nonzero(out.step_std) == 0
