"""The CPS step (Coefficients-Preserving Sampling, Wang et al. 2025) against hand computation."""

import math

import pytest
import torch

from rollout.cps import cps_step
from rollout.sde import sde_step

pytestmark = pytest.mark.core


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_mean_std_and_log_prob_equal_hand_computation(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64).float() for _ in range(3))
    eta = 0.8
    st = cps_step(x, v, sigma, sigma_next, noise_level=eta, noise=z)
    s = sigma_next * math.sin(eta * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next ** 2 - s ** 2) * x1
    torch.testing.assert_close(st.mean, mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(st.std_dev_t, torch.full((3,), s), rtol=0, atol=1e-7)
    assert torch.equal(st.step_std, st.std_dev_t)  # the noise's std is the log-prob's and the KL's
    torch.testing.assert_close(st.prev_sample, mean + s * z, rtol=0, atol=1e-6)
    want = torch.distributions.Normal(st.mean, s).log_prob(st.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(st.log_prob, want, rtol=0, atol=1e-5)  # normaliser and log-std included
    again = cps_step(x, v, sigma, sigma_next, noise_level=eta, prev_sample=st.prev_sample)
    assert torch.equal(again.log_prob, st.log_prob)


def test_noise_level_zero_is_the_euler_step_and_the_last_step_is_deterministic():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    for sigma, sigma_next in ((1.0, 0.8), (0.5, 0.3), (0.1, 0.0)):
        st = cps_step(x, v, sigma, sigma_next, noise_level=0.0)
        torch.testing.assert_close(st.prev_sample, x + (sigma_next - sigma) * v, rtol=0, atol=1e-6)
        assert torch.equal(st.log_prob, torch.zeros(4))
        ode = sde_step(x, v, sigma, sigma_next, noise_level=0.0, sigma_after_one=0.8)
        torch.testing.assert_close(st.prev_sample, ode.prev_sample, rtol=0, atol=1e-6)
    last = cps_step(x, v, 0.1, 0.0, noise_level=0.8)  # sigma_next = 0: s = 0, no noise needed
    assert torch.equal(last.log_prob, torch.zeros(4)) and torch.equal(last.std_dev_t, torch.zeros(4))
    with pytest.raises(ValueError, match="pass `noise`"):
        cps_step(x, v, 0.5, 0.3, noise_level=0.8)
