"""Reward-gradient methods against closed forms on a 1-D linear "model" v(x, sigma) = a x with the
quadratic reward r(x) = -(x - c)^2 (decoder: identity), in float64 but for the reward, float32 as every
reward (hence the 1e-6 tolerance).

Euler steps multiply: x_{k+1} = x_k (1 + a d_k), d_k = sigma_{k+1} - sigma_k, so with the first N - K
steps detached, x_N = x_{N-K} prod_{k >= N-K} (1 + a d_k) and
d(-r)/da = 2 (x_N - c) x_{N-K} sum_{j >= N-K} d_j prod_{k >= N-K, k != j} (1 + a d_k)."""

import math

import pytest
import torch

from posttrain.objectives.reward_gradient import Chain, alignprop, draft_k, draft_lv, refl

pytestmark = pytest.mark.core

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0], dtype=torch.float64)
X_T, A, C = 1.7, -0.6, 0.25


def chain(a: torch.nn.Parameter, checkpoint: bool = False, x=X_T) -> Chain:
    return Chain(velocity=lambda x, s: a * x, sigmas=SIGMAS, noise=torch.tensor([x], dtype=torch.float64),
                 decode=lambda z: z, reward=lambda z: -(z - C) ** 2, checkpoint=checkpoint)


def closed_form(k: int) -> float:
    d = (SIGMAS[1:] - SIGMAS[:-1]).tolist()
    n = len(d)
    x = X_T * math.prod(1 + A * dk for dk in d[:n - k])
    tail = d[n - k:]
    x_n = x * math.prod(1 + A * dk for dk in tail)
    dprod = sum(dj * math.prod(1 + A * dk for i, dk in enumerate(tail) if i != j) for j, dj in enumerate(tail))
    return 2 * (x_n - C) * x * dprod


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_draft_k_gradient_is_the_closed_form_of_k_unrolled_steps(k, checkpoint):
    a = torch.nn.Parameter(torch.tensor(A, dtype=torch.float64))
    loss, metrics = draft_k(chain(a, checkpoint), k)
    loss.backward()
    assert metrics["grad_steps"] == k
    assert a.grad.item() == pytest.approx(closed_form(k), rel=1e-6)
    # and the loss is -r of the full chain (truncation changes the gradient, not the sample)
    x_n = X_T * math.prod(1 + A * d for d in (SIGMAS[1:] - SIGMAS[:-1]).tolist())
    assert loss.item() == pytest.approx((x_n - C) ** 2, rel=1e-6)


def test_refl_predicts_x0_in_one_step_from_its_drawn_step():
    a = torch.nn.Parameter(torch.tensor(A, dtype=torch.float64))
    loss, metrics = refl(chain(a), last=3, generator=torch.Generator().manual_seed(0))
    loss.backward()
    t = int(metrics["refl_step"])
    assert 2 <= t <= 4
    d = (SIGMAS[1:] - SIGMAS[:-1]).tolist()
    x_t = X_T * math.prod(1 + A * dk for dk in d[:t])
    s = SIGMAS[t].item()
    x0 = x_t * (1 - s * A)  # x - sigma v with v = a x
    assert loss.item() == pytest.approx((x0 - C) ** 2, rel=1e-6)
    assert a.grad.item() == pytest.approx(2 * (x0 - C) * (-s * x_t), rel=1e-6)


def test_draft_lv_averages_the_last_step_over_renoisings():
    a = torch.nn.Parameter(torch.tensor(A, dtype=torch.float64))
    loss, _ = draft_lv(chain(a), n_noise=3, generator=torch.Generator().manual_seed(1))
    loss.backward()
    d = (SIGMAS[1:] - SIGMAS[:-1]).tolist()
    x0 = X_T * math.prod(1 + A * dk for dk in d)
    s = SIGMAS[-2].item()
    eps = torch.randn((3, 1), generator=torch.Generator().manual_seed(1), dtype=torch.float64).flatten().tolist()
    xs = [(1 - s) * x0 + s * e for e in eps]
    preds = [x * (1 - s * A) for x in xs]
    assert loss.item() == pytest.approx(sum((p - C) ** 2 for p in preds) / 3, rel=1e-6)
    assert a.grad.item() == pytest.approx(sum(2 * (p - C) * (-s * x) for p, x in zip(preds, xs)) / 3, rel=1e-6)


def test_alignprop_draws_k_and_matches_draft_k_with_it():
    seen = set()
    for seed in range(20):
        a = torch.nn.Parameter(torch.tensor(A, dtype=torch.float64))
        loss, metrics = alignprop(chain(a, checkpoint=True), k_max=3, generator=torch.Generator().manual_seed(seed))
        loss.backward()
        k = int(metrics["grad_steps"])
        seen.add(k)
        assert a.grad.item() == pytest.approx(closed_form(k), rel=1e-6)
    assert seen == {1, 2, 3}
