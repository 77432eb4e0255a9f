import math

import pytest
import torch

from pretrain.schedule import sample_training_sigmas, shift_sigmas, sigma_schedule
from pretrain.seeding import generator_for

pytestmark = pytest.mark.core


def test_unshifted_schedule_is_linear_from_one_to_zero():
    s = sigma_schedule(4)
    assert s.dtype == torch.float32
    assert s.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("shift", [0.5, 3.0, 7.0])
def test_shifted_schedule_matches_closed_form(shift):
    n = 10
    s = sigma_schedule(n, shift)
    for i in range(n + 1):
        t = 1 - i / n
        expected = shift * t / (1 + (shift - 1) * t)
        assert math.isclose(float(s[i]), expected, abs_tol=1e-7)
    # endpoints fixed, monotone decreasing
    assert s[0] == 1.0 and s[-1] == 0.0
    assert (s[1:] < s[:-1]).all()


def test_shift_three_at_half_is_three_quarters():
    # 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert float(shift_sigmas(torch.tensor(0.5), 3.0)) == pytest.approx(0.75)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        sigma_schedule(0)
    with pytest.raises(ValueError):
        shift_sigmas(torch.tensor(0.5), 0.0)


def test_training_sigmas_use_the_same_shift_and_are_reproducible():
    gens = lambda: [generator_for(0, "train", 0, i) for i in range(512)]  # noqa: E731
    a = sample_training_sigmas(gens(), 0.0, 1.0, shift=3.0)
    b = sample_training_sigmas(gens(), 0.0, 1.0, shift=3.0)
    assert torch.equal(a, b)
    assert ((a > 0) & (a < 1)).all()
    raw = sample_training_sigmas(gens(), 0.0, 1.0, shift=1.0)
    torch.testing.assert_close(a, shift_sigmas(raw.double(), 3.0).float())
    # logit-normal(0, 1) is symmetric around 0.5: the median of the unshifted draws is near 0.5
    assert abs(float(raw.median()) - 0.5) < 0.06
