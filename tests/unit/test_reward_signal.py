"""Rewards that carry no signal: non-finite rewards are "not applicable", zero spread is judged up to
float rounding, and a run whose rewards score nothing stops before its update."""

import numpy as np
import pytest
import torch

from posttrain.objectives.advantages import group_advantages, has_spread, per_reward_advantages
from posttrain.grpo.parts.per_prompt_advantage import PerPromptAdvantage
from posttrain.base.signal_guard import NoSignalError, SignalGuard
from rewards.base import weighted_sum

pytestmark = pytest.mark.core


def _rounded_035() -> torch.Tensor:
    """Eight float32 rewards that all mean 0.35 but differ in the last bits (as sums computed in
    different orders do): population std ~3e-8."""
    base = np.float32(0.35)
    ups = [base, np.nextafter(base, np.float32(1)), base, np.nextafter(base, np.float32(0))] * 2
    r = torch.tensor(np.array(ups, dtype=np.float32))
    assert 0 < float(r.double().std(unbiased=False)) < 1e-7
    return r


def test_rewards_equal_up_to_rounding_are_zero_spread_with_zero_advantages():
    adv, valid, zero = group_advantages(_rounded_035(), torch.zeros(8, dtype=torch.long))
    assert adv.tolist() == [0.0] * 8 and zero.all() and valid.all()


def test_a_small_real_spread_is_kept():
    r = torch.tensor([0.35, 0.35, 0.35, 0.3501])  # std 4.3e-5 = 1.2e-4 of the scale: a real difference
    adv, _, zero = group_advantages(r, torch.zeros(4, dtype=torch.long))
    assert not zero.any() and adv[3] > 0.2
    assert has_spread(torch.tensor([0.0, 1e-9])) and not has_spread(torch.tensor([0.0, 0.0]))
    assert not has_spread(torch.tensor([5.0]))


def test_per_prompt_statistics_use_the_same_tolerance():
    part = PerPromptAdvantage(PerPromptAdvantage.Config(buffer_size=8, min_count=1))
    adv, valid, zero = part(_rounded_035(), {}, {}, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    assert adv.tolist() == [0.0] * 8 and zero.all()


def test_inf_rewards_are_not_applicable_like_nan():
    r = torch.tensor([1.0, float("inf"), 3.0, float("-inf")])
    adv, valid, _ = group_advantages(r, torch.zeros(4, dtype=torch.long))
    assert valid.tolist() == [True, False, True, False] and adv[1] == 0 and adv[3] == 0
    assert adv[0] == pytest.approx(-1 / (1 + 1e-4)) and adv[2] == pytest.approx(1 / (1 + 1e-4))
    # an inf component is skipped in the weighted sum, as a NaN one: the other reward decides, its weight
    # renormalised to the total weight (2)
    total = weighted_sum({"a": torch.tensor([float("inf"), 2.0]), "b": torch.tensor([4.0, float("nan")])},
                         {"a": 1.0, "b": 1.0})
    assert total.tolist() == [8.0, 4.0]
    _, valid, zero = per_reward_advantages({"a": torch.full((4,), float("inf")), "b": torch.arange(4.0)},
                                           {"a": 1.0, "b": 1.0}, torch.zeros(4, dtype=torch.long))
    assert valid.all() and not zero.any()


def test_no_finite_reward_stops_at_once_naming_the_counts():
    guard = SignalGuard(max_no_signal=10)
    raw = {"jpeg": torch.full((6,), float("nan")), "clip": torch.tensor([float("inf")] * 6)}
    with pytest.raises(NoSignalError, match=r"iteration 3: no sample has a finite reward \(jpeg: 6 of 6 "
                                            r"non-finite, clip: 6 of 6 non-finite\)"):
        guard.check(3, weighted_sum(raw, {"jpeg": 1.0, "clip": 1.0}), raw, torch.ones(6, dtype=torch.bool))


def test_zero_spread_streak_stops_on_the_nth_iteration_and_resets():
    guard = SignalGuard(max_no_signal=3)
    total, zero, some = torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([True, True, False, False])
    raw = {"a": total, "dead": torch.full((4,), float("nan"))}
    lines = guard.check(1, total, raw, zero)
    assert "reward dead is non-finite for all 4 samples" in lines[0] and "1 in a row" in lines[1]
    guard.check(2, total, raw, zero)
    assert guard.check(3, total, raw, some)[1:] == [] and guard.streak == 0  # a group with spread resets it
    guard.check(4, total, raw, zero)
    state = guard.state_dict()
    guard.check(5, total, raw, zero)
    with pytest.raises(NoSignalError, match=r"iteration 6: every group has had zero reward spread for 3 iterations"):
        guard.check(6, total, raw, zero)
    resumed = SignalGuard(3)
    resumed.load_state_dict(state)
    resumed.check(5, total, raw, zero)
    with pytest.raises(NoSignalError):
        resumed.check(6, total, raw, zero)
    never = SignalGuard(0)
    for i in range(20):
        never.check(i + 1, total, raw, zero)
