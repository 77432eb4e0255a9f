"""The two FlowMatchEulerDiscreteScheduler schedules (pretrain.models.flow_schedule) against exact rational
arithmetic: the pipeline's, shifted twice at shift 3 (diffusers#13243), and the single-shift one."""

from fractions import Fraction

import pytest
import torch

from pretrain.models.flow_schedule import checked_schedule, set_flow_timesteps

pytestmark = pytest.mark.core


def shifted(s: Fraction, shift: int = 3) -> Fraction:
    """SD3's shift s' = shift * s / (1 + (shift - 1) * s), exact."""
    return shift * s / (1 + (shift - 1) * s)


def hand_schedule(first: Fraction, last: Fraction, n: int) -> list[Fraction]:
    """shift(linspace(first, last, n)), exact, then the final 0."""
    return [shifted(first + (last - first) * i / (n - 1)) for i in range(n)] + [Fraction(0)]


def scheduler_sigmas(schedule: str, n: int = 10, **config) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, **config)
    set_flow_timesteps(scheduler, n, schedule)
    return scheduler.sigmas


def test_shift_3_ten_steps_equal_the_hand_computed_schedules(capsys):
    smallest = Fraction(1, 1000)  # the scheduler's unshifted sigma_min: 1 / num_train_timesteps
    single = hand_schedule(Fraction(1), smallest, 10)  # linspace(1, 1/1000, 10), shifted once
    double = hand_schedule(Fraction(1), shifted(smallest), 10)  # from the already-shifted sigma_min, again
    assert (single[-2], double[-2]) == (Fraction(1, 334), Fraction(1, 112))  # 0.002994 and 0.008929
    got = {"single_shift": scheduler_sigmas("single_shift"), "pipeline": scheduler_sigmas("pipeline")}
    with capsys.disabled():
        print("\nshift 3, 10 steps: " + "; ".join(f"{k} last nonzero {v[-2].item():.6f}" for k, v in got.items()))
    for name, want in (("single_shift", single), ("pipeline", double)):
        sig = got[name]
        assert sig.dtype == torch.float32 and sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0
        assert (sig.double() - torch.tensor([float(w) for w in want], dtype=torch.float64)).abs().max() <= 1e-7, name
    assert abs(got["pipeline"][-2].item() - 0.008929) < 5e-7 and abs(got["single_shift"][-2].item() - 0.002994) < 5e-7


def test_pipeline_is_set_timesteps_as_is_and_dynamic_shift_makes_them_agree():
    from diffusers import FlowMatchEulerDiscreteScheduler

    plain = FlowMatchEulerDiscreteScheduler(shift=3.0)
    plain.set_timesteps(10)
    assert torch.equal(scheduler_sigmas("pipeline"), plain.sigmas)
    dynamic = {}
    for schedule in ("pipeline", "single_shift"):  # the scheduler keeps an unshifted sigma_min: one shift either way
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        set_flow_timesteps(scheduler, 10, schedule, mu=0.8)
        dynamic[schedule] = scheduler.sigmas
    assert (dynamic["pipeline"] - dynamic["single_shift"]).abs().max() <= 1e-6


def test_schedule_option_is_checked():
    assert checked_schedule({}) == "pipeline" and checked_schedule({"schedule": "single_shift"}) == "single_shift"
    with pytest.raises(ValueError, match=r"model\.options\.schedule: 'double' is not one of \['pipeline', "):
        checked_schedule({"schedule": "double"})
