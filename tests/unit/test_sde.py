import math

import pytest
import torch

from pretrain.flow import euler_step
from pretrain.schedule import sigma_schedule
from rollout.sde import gaussian_log_prob, sde_step

pytestmark = pytest.mark.core


def test_one_step_by_hand():
    # scalar state: x = 0.5, v = -1, sigma 0.6 -> 0.4, noise_level 0.5, z = 0.3
    x, v, z = torch.tensor([[0.5]]), torch.tensor([[-1.0]]), torch.tensor([[0.3]])
    st = sde_step(x, v, 0.6, 0.4, noise_level=0.5, sigma_after_one=0.9, noise=z)
    dt = -0.2
    std_dev_t = 0.5 * math.sqrt(0.6 / 0.4)
    mean = 0.5 + (-1.0) * dt + std_dev_t**2 / (2 * 0.6) * (0.5 + 0.4 * -1.0) * dt
    step_std = std_dev_t * math.sqrt(0.2)
    x_next = mean + step_std * 0.3
    lp = -(0.3**2) / 2 - math.log(step_std) - 0.5 * math.log(2 * math.pi)
    assert st.std_dev_t.item() == pytest.approx(std_dev_t, abs=1e-7)
    assert st.mean.item() == pytest.approx(mean, abs=1e-7)
    assert st.step_std.item() == pytest.approx(step_std, abs=1e-7)
    assert st.prev_sample.item() == pytest.approx(x_next, abs=1e-7)
    assert st.log_prob.item() == pytest.approx(lp, abs=1e-6)


def test_noise_level_zero_is_the_euler_step():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 4, generator=g), torch.randn(3, 4, 4, generator=g)
    st = sde_step(x, v, 0.7, 0.55, noise_level=0.0, sigma_after_one=0.9)
    assert (st.prev_sample - euler_step(x, v, torch.tensor(0.7), torch.tensor(0.55))).abs().max() <= 1e-6


def test_step_at_sigma_one_is_finite_and_uses_next_sigma():
    sig = sigma_schedule(10, 3.0)
    x, v, z = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    st = sde_step(x, v, sig[0], sig[1], noise_level=0.7, sigma_after_one=sig[1], noise=z)
    assert torch.isfinite(st.prev_sample).all() and torch.isfinite(st.log_prob).all()
    assert st.std_dev_t[0].item() == pytest.approx(0.7 * math.sqrt(1 / (1 - sig[1].item())), rel=1e-6)


def test_log_prob_recomputed_from_prev_sample_matches():
    x, v, z = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    a = sde_step(x, v, 0.5, 0.4, noise_level=0.7, sigma_after_one=0.9, noise=z)
    b = sde_step(x, v, 0.5, 0.4, noise_level=0.7, sigma_after_one=0.9, prev_sample=a.prev_sample)
    assert torch.equal(a.log_prob, b.log_prob)
    # per-element mean of a standard Gaussian log-density at the sampled z
    expected = (-(z**2) / 2 - torch.log(a.step_std.view(-1, 1, 1, 1)) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
    torch.testing.assert_close(a.log_prob, expected, rtol=0, atol=1e-5)


def test_gaussian_log_prob_is_zero_for_deterministic_rows():
    x = torch.zeros(2, 3)
    assert gaussian_log_prob(x, x, torch.tensor([0.0, 1.0])).tolist()[0] == 0.0


def test_sde_keeps_the_ode_marginals_on_1d_gaussian_data():
    # x0 ~ N(m, s^2); x_sigma = (1 - sigma) x0 + sigma eps is N((1 - sigma) m, (1 - sigma)^2 s^2 + sigma^2).
    # Exact velocity E[eps - x0 | x_sigma] in closed form (Gaussian conditioning).
    m, s = 1.5, 0.5
    n = 200_000

    def velocity(x, sigma):
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        resid = x - (1 - sigma) * m
        e_eps = sigma / var * resid
        e_x0 = m + (1 - sigma) * s**2 / var * resid
        return e_eps - e_x0

    g = torch.Generator().manual_seed(0)
    sig = sigma_schedule(40)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64).float()
    for i in range(40):
        z = torch.randn(n, 1, generator=g)
        x = sde_step(x, velocity(x, sig[i].item()), sig[i], sig[i + 1], noise_level=0.7,
                     sigma_after_one=sig[1], noise=z).prev_sample
    se_mean = s / math.sqrt(n)
    assert abs(x.mean().item() - m) < 4 * se_mean + 0.01  # + discretisation error of 40 steps
    assert abs(x.var().item() - s**2) < 0.03 * s**2 + 0.01
