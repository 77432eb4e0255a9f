"""DPM-Solver++(2M) in flow coordinates (rollout.dpm_solver) against diffusers' DPMSolverMultistepScheduler
and against the Euler step it reduces to at first order."""

import pytest
import torch

from pretrain.schedule import sigma_schedule
from rollout.dpm_solver import dpmpp_2m_update, flow_data_prediction
from rollout.ode_solver import dpmpp_2m

pytestmark = pytest.mark.core

SHAPE = (2, 4, 6, 6)


def velocity_field(dtype):
    """A fixed velocity v(x, sigma) = W x + sigma b (W mixes the 4 channels): not constant along the walk,
    so the multistep correction matters."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(4, 4, generator=g) * 0.5, torch.randn(1, 4, 1, 1, generator=g)
    return lambda x, sigma: torch.einsum("oc,bchw->bohw", w.to(dtype), x) + float(sigma) * b.to(dtype)


def diffusers_scheduler(num_steps, sigmas=None):
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        lower_order_final=True, final_sigmas_type="zero")
    sched.set_timesteps(num_steps)
    if sigmas is not None:  # walk our schedule: the scheduler indexes its sigmas by step count only
        assert sigmas.shape == sched.sigmas.shape
        sched.sigmas = sigmas.clone()
    sched.set_begin_index(0)
    return sched


def walks(num_steps, dtype, sigmas=None):
    """(ours, diffusers', euler): the states of the deterministic walk from the same noise, ``[T + 1, *SHAPE]``."""
    sched = diffusers_scheduler(num_steps, sigmas)
    sig, v_of = sched.sigmas, velocity_field(dtype)
    x0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=dtype)
    ours, theirs, euler, previous = [x0], [x0], [x0], None
    for t in range(num_steps):
        x = ours[-1]
        v = v_of(x, sig[t])
        ours.append(dpmpp_2m(None, x, v, sig[t], sig[t + 1], previous).prev_sample.to(dtype))
        previous = (x, v, sig[t])
        theirs.append(sched.step(v_of(theirs[-1], sig[t]), sched.timesteps[t], theirs[-1]).prev_sample)
        euler.append(euler[-1] + (sig[t + 1] - sig[t]) * v_of(euler[-1], sig[t]))
    return torch.stack(ours), torch.stack(theirs), torch.stack(euler)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_steps,schedule", [(10, "diffusers"), (20, "diffusers"), (10, "ours"), (25, "ours")])
def test_walk_equals_diffusers_dpm_solver_multistep(num_steps, schedule, dtype, capsys):
    sigmas = sigma_schedule(num_steps, 3.0) if schedule == "ours" else None  # ours starts at exactly sigma 1
    ours, theirs, euler = walks(num_steps, dtype, sigmas)
    diff = (ours - theirs).abs().max().item()
    with capsys.disabled():
        print(f"\ndpmpp_2m vs DPMSolverMultistepScheduler ({schedule} schedule, {num_steps} steps, {dtype}): "
              f"max |diff| {diff:.2e} (states up to {theirs.abs().max().item():.1f})")
    assert torch.isfinite(ours).all() and diff <= 1e-5
    assert (ours[-1] - euler[-1]).abs().max() > 1e-3  # second order: not the Euler walk


def test_first_order_is_the_euler_step_and_the_step_to_zero_is_x0():
    g = torch.Generator().manual_seed(1)
    x, v, x0_prev = (torch.randn(SHAPE, generator=g) for _ in range(3))
    for sigma, sigma_next in ((1.0, 0.8), (0.6, 0.45), (0.1, 0.02)):
        got = dpmpp_2m_update(x, flow_data_prediction(x, v, sigma), sigma, sigma_next)
        torch.testing.assert_close(got, x + (sigma_next - sigma) * v, rtol=0, atol=2e-6)
    x0 = flow_data_prediction(x, v, 0.1)
    assert torch.equal(dpmpp_2m_update(x, x0, 0.1, 0.0, x0_prev, 0.3), x0)  # lower_order_final: x0_hat
    # a previous sigma of 1 (lambda = -inf): r = 0, the first-order step, as diffusers
    assert torch.equal(dpmpp_2m_update(x, x0, 0.9, 0.7, x0_prev, 1.0), dpmpp_2m_update(x, x0, 0.9, 0.7))
    # with a history the step is second order: r / 2 (x0 - x0_prev) moves it
    assert (dpmpp_2m_update(x, x0, 0.6, 0.45, x0_prev, 0.8) - dpmpp_2m_update(x, x0, 0.6, 0.45)).abs().max() > 1e-2


def test_per_sample_sigmas_equal_scalar_sigmas():
    g = torch.Generator().manual_seed(2)
    x, v, xp, vp = (torch.randn(SHAPE, generator=g) for _ in range(4))
    sig, nxt, prev = torch.tensor([0.7, 0.4]), torch.tensor([0.5, 0.0]), torch.tensor([0.9, 0.6])
    rows = dpmpp_2m(None, x, v, sig, nxt, (xp, vp, prev))
    for i in range(2):
        one = dpmpp_2m(None, x[i:i + 1], v[i:i + 1], sig[i], nxt[i], (xp[i:i + 1], vp[i:i + 1], prev[i]))
        assert torch.equal(rows.prev_sample[i:i + 1], one.prev_sample)
    assert torch.equal(rows.log_prob, torch.zeros(2)) and rows.prev_sample.dtype == torch.float32
