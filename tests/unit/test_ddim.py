"""The DDIM step with eta (DDPO's sampler) against hand computation and diffusers' DDIMScheduler."""

import math

import pytest
import torch

from rollout.ddim import ddim_step
from rollout.sde import sde_step

pytestmark = pytest.mark.core


def _n(sigma: float) -> float:
    return math.sqrt((1 - sigma) ** 2 + sigma ** 2)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_mean_std_and_log_prob_equal_hand_computation(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64).float() for _ in range(3))
    eta = 1.0
    st = ddim_step(x, v, sigma, sigma_next, noise_level=eta, noise=z)
    a, a_next = ((1 - sigma) / _n(sigma)) ** 2, ((1 - sigma_next) / _n(sigma_next)) ** 2
    std_vp = eta * math.sqrt((1 - a_next) / (1 - a) * (1 - a / a_next))  # Song et al. 2021, eq. 16
    std = _n(sigma_next) * std_vp
    x0, eps = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next ** 2 - std ** 2) * eps
    torch.testing.assert_close(st.mean, mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(st.std_dev_t, torch.full((3,), std), rtol=0, atol=1e-7)
    assert torch.equal(st.step_std, st.std_dev_t)  # the noise's std is the log-prob's and the KL's
    torch.testing.assert_close(st.prev_sample, mean + std * z, rtol=0, atol=1e-6)
    elem = -((st.prev_sample - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(st.log_prob, elem.flatten(1).mean(1), rtol=0, atol=1e-5)
    want = torch.distributions.Normal(st.mean, std).log_prob(st.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(st.log_prob, want, rtol=0, atol=1e-5)
    again = ddim_step(x, v, sigma, sigma_next, noise_level=eta, prev_sample=st.prev_sample)
    assert torch.equal(again.log_prob, st.log_prob)


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear"])
def test_equals_diffusers_ddim_with_eta_one_and_ddpo_log_prob(beta_schedule):
    """Our step on the flow state y = n(sigma) x_t is diffusers' DDIMScheduler.step (eta 1, same noise) on
    x_t, scaled by n(sigma_next); our log-prob is DDPO's (the density of x_next) minus log n(sigma_next)."""
    from diffusers import DDIMScheduler

    from pretrain.models.unet.vp_schedule import VPSchedule, flow_velocity

    sch = DDIMScheduler(beta_schedule=beta_schedule, beta_start=0.00085, beta_end=0.012, clip_sample=False,
                        set_alpha_to_one=True, timestep_spacing="leading")
    steps = 10
    sigmas = VPSchedule(sch).sigmas(steps)
    sch.set_timesteps(steps)
    ac = sch.alphas_cumprod.double()
    g = torch.Generator().manual_seed(3)
    worst_x, worst_lp = 0.0, 0.0
    for i, t in enumerate(sch.timesteps.tolist()):
        x_t = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)
        eps_hat, z = torch.randn_like(x_t), torch.randn_like(x_t)
        ref = sch.step(eps_hat, t, x_t, eta=1.0, variance_noise=z).prev_sample
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        y = x_t * _n(sigma)
        v = flow_velocity(eps_hat, y.float(), torch.full((2,), sigma), "epsilon")
        ours = ddim_step(y.float(), v, sigma, sigma_next, noise_level=1.0, noise=z.float())
        worst_x = max(worst_x, float((ours.prev_sample.double() / _n(sigma_next) - ref).abs().max()))
        prev_t = t - sch.config.num_train_timesteps // steps
        a, a_prev = float(ac[t]), (float(ac[prev_t]) if prev_t >= 0 else 1.0)
        std_x = math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        if std_x > 0:  # DDPO's log-prob of x_next under N(mean_x, std_x^2), per-element mean
            mean_x = math.sqrt(a_prev) * (x_t - math.sqrt(1 - a) * eps_hat) / math.sqrt(a) \
                + math.sqrt(1 - a_prev - std_x ** 2) * eps_hat
            ddpo = torch.distributions.Normal(mean_x, std_x).log_prob(ref).flatten(1).mean(1)
            worst_lp = max(worst_lp, float((ours.log_prob.double() - (ddpo - math.log(_n(sigma_next)))).abs().max()))
        else:
            assert torch.equal(ours.log_prob, torch.zeros(2))
    assert worst_x < 1e-5 and worst_lp < 1e-4, (worst_x, worst_lp)


def test_eta_zero_is_the_euler_step_and_the_last_step_is_deterministic():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    for sigma, sigma_next in ((1.0, 0.8), (0.5, 0.3), (0.1, 0.0)):
        st = ddim_step(x, v, sigma, sigma_next, noise_level=0.0)
        torch.testing.assert_close(st.prev_sample, x + (sigma_next - sigma) * v, rtol=0, atol=1e-6)
        assert torch.equal(st.log_prob, torch.zeros(4))
        ode = sde_step(x, v, sigma, sigma_next, noise_level=0.0, sigma_after_one=0.8)
        torch.testing.assert_close(st.prev_sample, ode.prev_sample, rtol=0, atol=1e-6)
    last = ddim_step(x, v, 0.1, 0.0, noise_level=1.0)  # sigma_next = 0: a' = 1, no noise
    assert torch.equal(last.log_prob, torch.zeros(4)) and torch.equal(last.std_dev_t, torch.zeros(4))
    with pytest.raises(ValueError, match="pass `noise`"):
        ddim_step(x, v, 0.5, 0.3, noise_level=1.0)
