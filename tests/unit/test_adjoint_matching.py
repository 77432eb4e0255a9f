"""Adjoint Matching's pieces against closed forms (paper time t: noise at 0, data at 1).

1. The lean adjoint of a linear base velocity v = a x (drift b = 2 a x - x / t, db/dx = 2 a - 1 / t) is
   a(t) = a(1) t exp(2 a (1 - t)).
2. The fixed point on 1-D Gaussians: base data N(mu, s^2), reward r(x) = -(x - c)^2 / (2 tau^2); the
   tilted distribution is N(mu*, s*^2) with 1/s*^2 = 1/s^2 + 1/tau^2 and mu* = s*^2 (mu/s^2 + c/tau^2).
   Under the optimal (memoryless) process X_0 ~ N(0, 1) and X_1 ~ N(mu*, s*^2) are independent, the
   lean adjoint is linear in X_1 (the base drift is affine), and the regression target's conditional
   mean E[v_base - sigma^2 a / 2 | X_t = x] must be the flow velocity of N(mu*, s*^2)."""

import math

import pytest
import torch

from posttrain.objectives.adjoint_matching import adjoint_matching_loss, lean_adjoint, memoryless_sigma2, \
    memoryless_step, regression_target

pytestmark = pytest.mark.core


def gaussian_velocity(x, t, m, var):
    """The flow velocity E[X_1 - X_0 | X_t = x] for X_1 ~ N(m, var), X_0 ~ N(0, 1)."""
    vt = (1 - t) ** 2 + t ** 2 * var
    return m + (t * var - (1 - t)) * (x - t * m) / vt


def vjp_of(velocity):
    """(db/dx)^T a for b = 2 v(x, t) - x / t, by autograd."""
    def vjp(x, t, a):
        x = x.detach().requires_grad_(True)
        b = 2 * velocity(x, t) - x / t
        return torch.autograd.grad(b, x, a)[0]
    return vjp


def test_lean_adjoint_of_a_linear_drift_is_the_analytic_one():
    a_coef = -0.7
    ts = torch.linspace(0.05, 1.0, 4001, dtype=torch.float64).tolist()
    xs = [torch.zeros(3, dtype=torch.float64) for _ in ts]  # a linear drift: the states do not matter
    a1 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    adj = lean_adjoint(vjp_of(lambda x, t: a_coef * x), xs, ts, a1)
    for k in (0, 1000, 3000, 4000):
        t = ts[k]
        exact = a1 * t * math.exp(2 * a_coef * (1 - t))
        torch.testing.assert_close(adj[k], exact, rtol=2e-3, atol=0)  # Euler, first order in h = 2.4e-4


def test_the_fixed_point_is_the_tilted_gaussians_flow():
    mu, s, c, tau = 0.5, 0.8, 1.5, 0.7
    var_star = 1 / (1 / s ** 2 + 1 / tau ** 2)
    mu_star = var_star * (mu / s ** 2 + c / tau ** 2)
    base = lambda x, t: gaussian_velocity(x, t, mu, s ** 2)  # noqa: E731
    ts = torch.linspace(0.02, 1.0, 20001, dtype=torch.float64).tolist()
    xs = [torch.zeros(1, dtype=torch.float64) for _ in ts]
    phi = lean_adjoint(vjp_of(base), xs, ts, torch.ones(1, dtype=torch.float64))  # a(t) = phi(t) a(1)
    for k in (1000, 5000, 12000, 19000):
        t = ts[k]
        for x in (-1.0, 0.3, 2.0):
            vt = (1 - t) ** 2 + t ** 2 * var_star
            e_x1 = mu_star + t * var_star * (x - t * mu_star) / vt  # E[X_1 | X_t = x] at the optimum
            a = phi[k] * (e_x1 - c) / tau ** 2  # E[a(t) | X_t = x], a(1) = -grad r(X_1) = (X_1 - c) / tau^2
            target = regression_target(torch.tensor([base(x, t)], dtype=torch.float64), a, t)
            assert target.item() == pytest.approx(gaussian_velocity(x, t, mu_star, var_star), abs=2e-3)


def test_the_loss_is_zero_at_the_target_and_the_step_follows_the_sde():
    v_base, a = torch.randn(4, 3), torch.randn(4, 3)
    t = 0.3
    assert adjoint_matching_loss(regression_target(v_base, a, t), v_base, a, t).abs().max() < 1e-10
    # u = 2 (v_ft - v_base) / sigma: the loss is |u + sigma a|^2 averaged over elements
    v_ft = torch.randn(4, 3)
    sigma = memoryless_sigma2(t) ** 0.5
    expect = (2 * (v_ft - v_base) / sigma + sigma * a).square().mean(1)
    torch.testing.assert_close(adjoint_matching_loss(v_ft, v_base, a, t), expect)
    x, v, noise = torch.randn(5), torch.randn(5), torch.randn(5)
    h = 0.1
    torch.testing.assert_close(memoryless_step(x, v, t, t + h, noise),
                               x + h * (2 * v - x / t) + math.sqrt(h * 2 * (1 - t) / t) * noise)
