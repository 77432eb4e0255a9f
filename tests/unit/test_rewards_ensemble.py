"""ensemble: the NaN-aware mean of member rewards, built from a config the way GRPO builds rewards."""

import math

import pytest
import torch

from rewards.base import CompositeReward, build_reward

pytestmark = pytest.mark.core


def brightness(images, prompts=None, metadata=None):
    return images.float().mean(dim=(1, 2, 3))


def half_nan(images, prompts=None, metadata=None, value: float = 0.0):
    out = torch.full((images.shape[0],), float(value))
    out[0] = float("nan")
    return out


def test_ensemble_is_the_nan_aware_mean_of_its_members():
    images = torch.stack([torch.full((3, 4, 4), 0.2), torch.full((3, 4, 4), 0.6)])
    members = [{"name": "tests.unit.test_rewards_ensemble:brightness"},
               {"name": "tests.unit.test_rewards_ensemble:half_nan", "value": 1.0}]
    got = build_reward("ensemble", members=members)(images, ["a", "b"])
    # sample 0: the second member is NaN there, so the mean of the first alone; sample 1: (0.6 + 1) / 2
    torch.testing.assert_close(got, torch.tensor([0.2, 0.8]))
    # as a config entry {ensemble: {weight, members}}, scored like any reward
    total, raw = CompositeReward({"ensemble": {"weight": 2.0, "members": members}})(images, ["a", "b"])
    torch.testing.assert_close(raw["ensemble"], torch.tensor([0.2, 0.8]))
    torch.testing.assert_close(total, torch.tensor([0.4, 1.6]))  # weight 2
    only_nan = build_reward("ensemble", members=[members[1]])(images, ["a", "b"])
    assert math.isnan(only_nan[0].item()) and only_nan[1].item() == 1.0


def test_ensemble_errors_name_the_member():
    with pytest.raises(ValueError, match="at least one"):
        build_reward("ensemble", members=[])
    with pytest.raises(ValueError, match=r"ensemble.members.1: missing 'name'"):
        build_reward("ensemble", members=[{"name": "jpeg_compressibility"}, {"path": "x"}])
    with pytest.raises(ValueError, match=r"ensemble.members.0: must be a mapping"):
        build_reward("ensemble", members=["jpeg_compressibility"])


@pytest.mark.parametrize("members,match", [
    ([{"name": "nope"}], r"rewards.ensemble.members.0: unknown reward\(s\) \['nope'\]"),
    ([{"name": "jpeg_compressibility"}, {"name": "jpeg_compressibility", "qualty": 90}],
     r"rewards.ensemble.members.1.jpeg_compressibility: bad parameters \['qualty'\]"),
    ([], r"rewards.ensemble.members: give at least one"),
])
def test_ensemble_members_are_checked_when_the_config_loads(members, match):
    from rewards.base import check_reward_weights

    check_reward_weights({"ensemble": {"weight": 1.0, "members": [{"name": "jpeg_compressibility"}]}})
    with pytest.raises(ValueError, match=match):  # nothing is built: this runs before any model is read
        check_reward_weights({"ensemble": {"weight": 1.0, "members": members}})
