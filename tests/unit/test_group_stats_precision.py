"""Group statistics stay exact near a large constant: advantages equal a float64 two-pass reference on
float32 rewards 1e6 + N(0, 30^2) (where float32 arithmetic loses ~2e-3 of an advantage and the one-pass
E[r^2] - E[r]^2 in float32 is off by 100x), with a NaN member in a group."""

import pytest
import torch

from posttrain.grpo.parts.per_prompt_advantage import PerPromptAdvantage
from posttrain.objectives.advantages import group_advantages

pytestmark = pytest.mark.core


def _rewards() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = (1e6 + 30 * torch.randn(16, generator=g, dtype=torch.float64)).float()
    r[3] = float("nan")  # group 0: one "not applicable" member
    return r, torch.arange(16) // 8


def _reference(r: torch.Tensor, ids: torch.Tensor, eps: float) -> torch.Tensor:
    """Two-pass float64 (r - mean) / (population std + eps) per group; 0 for a NaN reward."""
    out = torch.zeros(len(r), dtype=torch.float64)
    for g in ids.unique():
        m = (ids == g) & torch.isfinite(r)
        x = r[m].double()
        mean = x.sum() / x.numel()
        out[m] = (x - mean) / (((x - mean) ** 2).sum().div(x.numel()).sqrt() + eps)
    return out


def test_the_one_pass_float32_variance_is_wrong_here():
    r, ids = _rewards()
    x = r[(ids == 1)]
    true = float(x.double().var(unbiased=False))
    assert 600 < true < 1500  # std ~30
    one_pass = float((x * x).mean() - x.mean() ** 2)  # the formula this guards against: 131072 here
    assert abs(one_pass - true) > 10 * true


def test_group_advantages_equal_a_float64_two_pass_reference_near_1e6():
    r, ids = _rewards()
    adv, valid, zero = group_advantages(r, ids, adv_clip_max=5.0)
    ref = _reference(r, ids, 1e-4)
    assert adv.dtype == torch.float32
    assert valid.tolist() == [i != 3 for i in range(16)] and not zero.any()
    assert adv[3] == 0.0
    largest = float(ref.abs().max())
    assert largest > 1.0 and largest < 5.0  # no clipping: every value is compared
    torch.testing.assert_close(adv.double(), ref, rtol=0, atol=1e-6)


def test_per_prompt_advantages_equal_a_float64_two_pass_reference_near_1e6():
    r, ids = _rewards()
    part = PerPromptAdvantage(PerPromptAdvantage.Config(buffer_size=8, min_count=1, clip_max=5.0))
    adv, valid, zero = part(r, {}, {}, ids, ids)
    assert adv.dtype == torch.float32 and adv[3] == 0.0 and not zero[valid].any()
    torch.testing.assert_close(adv.double(), _reference(r, ids, 1e-6), rtol=0, atol=1e-6)
