import pytest
import torch

from pretrain.flow import (cfg_combine, euler_sample, flow_matching_loss, interpolate, noise_matching_loss,
                           velocity_target)
from pretrain.schedule import sample_discrete_training_sigmas, sigma_schedule

pytestmark = pytest.mark.core


def test_interpolation_and_target_by_hand():
    x0 = torch.tensor([[1.0, -1.0]])
    eps = torch.tensor([[0.5, 2.0]])
    # x_0.25 = 0.75 * x0 + 0.25 * eps
    assert interpolate(x0, eps, torch.tensor([0.25])).tolist() == [[0.875, -0.25]]
    assert velocity_target(x0, eps).tolist() == [[-0.5, 3.0]]


def test_flow_matching_loss_equals_hand_computed_number():
    # two samples, two elements each
    x0 = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    eps = torch.tensor([[0.0, 1.0], [2.0, 1.0]])
    # targets eps - x0 = [[-1, 1], [2, 2]]; errors v - target = [[1, -1], [0, 1]]
    # -> per-sample means of squares [1, 0.5], batch mean 0.75
    v_pred = torch.tensor([[0.0, 0.0], [2.0, 3.0]])
    per_sample = flow_matching_loss(v_pred, x0, eps)
    assert per_sample.tolist() == [1.0, 0.5]
    assert float(per_sample.mean()) == 0.75


def test_noise_matching_loss_equals_hand_computed_number():
    # same numbers as above; sigma [0.5, 0.75] -> (1 - sigma) errors [[0.5, -0.5], [0, 0.25]]
    # -> per-sample means of squares [0.25, 0.03125]
    x0 = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    eps = torch.tensor([[0.0, 1.0], [2.0, 1.0]])
    v_pred = torch.tensor([[0.0, 0.0], [2.0, 3.0]])
    assert noise_matching_loss(v_pred, x0, eps, torch.tensor([0.5, 0.75])).tolist() == [0.25, 0.03125]
    # it is the epsilon error: eps_hat = x_sigma + (1 - sigma) v_pred
    sigma = torch.tensor([0.3, 0.9])
    eps_hat = interpolate(x0, eps, sigma) + (1 - sigma)[:, None] * v_pred
    assert torch.allclose(noise_matching_loss(v_pred, x0, eps, sigma), (eps_hat - eps).square().mean(1))


def test_discrete_training_sigmas_come_from_the_table():
    table = torch.tensor([0.1, 0.2, 0.4, 0.8])
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    draws = sample_discrete_training_sigmas(gens, table)
    assert draws.dtype == torch.float32 and draws.shape == (64,)
    assert set(draws.tolist()) == set(table.tolist())  # every entry, nothing else
    with pytest.raises(ValueError, match="non-empty 1-D table"):
        sample_discrete_training_sigmas(gens, torch.zeros(0))


def test_flow_matching_loss_is_float32_for_half_inputs():
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    assert flow_matching_loss(x, x, x).dtype == torch.float32


def test_cfg_combine_closed_form():
    c, u = torch.tensor([3.0]), torch.tensor([1.0])
    assert cfg_combine(c, u, 4.5).item() == 1.0 + 4.5 * 2.0
    assert cfg_combine(c, u, 1.0).item() == 3.0


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_with_exact_velocity_passes_through_every_interpolant(shift):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 4, 5, 5, generator=g)
    eps = torch.randn(3, 4, 5, 5, generator=g)
    sigmas = sigma_schedule(12, shift)

    def velocity(x, sigma):  # exact conditional field of (x0, eps): (x - x0) / sigma
        return (x - x0) / sigma.view(-1, 1, 1, 1)

    seen = []

    def check(i, sigma_next, x):
        expected = (1 - sigma_next) * x0 + sigma_next * eps
        seen.append(float((x - expected).abs().max()))

    out = euler_sample(velocity, eps.clone(), sigmas, callback=check)
    assert len(seen) == 12
    assert max(seen) <= 1e-5
    assert float((out - x0).abs().max()) <= 1e-5


def test_euler_with_wrong_field_is_caught():
    # the check above can fail: a velocity off by 1 % leaves the path
    x0, eps = torch.zeros(1, 4), torch.ones(1, 4)
    out = euler_sample(lambda x, s: 1.01 * (x - x0) / s.view(-1, 1), eps, sigma_schedule(4))
    assert float((out - x0).abs().max()) > 1e-3 or not torch.isfinite(out).all()
