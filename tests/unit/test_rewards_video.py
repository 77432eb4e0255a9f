"""Video rewards on synthetic clips with known motion (the moving-emoji generator)."""

import math

import pytest
import torch

from pretrain.data.emoji import render_emoji
from pretrain.data.moving_emoji import MOTIONS, make_clip, motion_caption
from rewards.base import build_reward
from rewards.motion import named_direction

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def apple():
    return render_emoji(["\U0001F34E"], size=12)[0]  # red apple, uint8 [3, 12, 12] on white


def clips(sprite, motions, frames=8, size=32):
    return torch.stack([make_clip(sprite, m, frames, size) for m in motions]).float() / 255


def test_motion_direction_scores_known_motion(apple):
    reward = build_reward("motion_direction")
    left = clips(apple, ["left", "left"])
    assert reward(left, ["a red apple moving left", "a red apple moving right"]).tolist() == [1.0, 0.0]
    static = make_clip(apple, "left", 2, 32)[:1].expand(8, -1, -1, -1)[None].float() / 255
    assert reward(static, ["a red apple moving left"]).tolist() == [0.0]
    # every motion scores 1 for its own caption and 0 for each other one
    videos = clips(apple, list(MOTIONS))
    for want in MOTIONS:
        got = reward(videos, [motion_caption("red apple", want)] * len(MOTIONS))
        assert got.tolist() == [float(m == want) for m in MOTIONS], want
    # a prompt naming no direction is not applicable
    assert math.isnan(reward(left[:1], ["a red apple"]).item())


def test_direction_words_and_bad_input():
    assert named_direction("Apple moving Up then down") == "down"
    assert named_direction("a leftover apple") is None
    with pytest.raises(ValueError, match=r"motion_direction .*\[B, F >= 2, 3, H, W\].*\(2, 3, 8, 8\)"):
        build_reward("motion_direction")(torch.zeros(2, 3, 8, 8), ["a", "b"])


def test_temporal_consistency_and_per_frame(apple):
    still = make_clip(apple, "left", 2, 32)[:1].expand(6, -1, -1, -1)[None].float() / 255
    moving = clips(apple, ["left"], frames=6)
    tc = build_reward("temporal_consistency")(torch.cat([still, moving]))
    assert tc[0].item() == 1.0 and 0.9 < tc[1].item() < 1.0
    flicker = torch.zeros(1, 4, 3, 8, 8)
    flicker[:, 1::2] = 1.0
    assert build_reward("temporal_consistency")(flicker).item() == 0.0
    # per_frame averages an image reward over frames: mean brightness of frame f is f / 3 here
    ramp = torch.arange(4).float().view(1, 4, 1, 1, 1).expand(2, 4, 3, 8, 8) / 3
    pf = build_reward("per_frame", reward="tests.unit.test_rewards_video:brightness")
    torch.testing.assert_close(pf(ramp, ["a", "b"]), torch.full((2,), 0.5))
    every2 = build_reward("per_frame", reward="tests.unit.test_rewards_video:brightness", every=2)
    torch.testing.assert_close(every2(ramp, ["a", "b"]), torch.full((2,), 1 / 3))


def brightness(images, prompts=None, metadata=None):
    return images.mean(dim=(1, 2, 3))


def test_motion_alignment_grades_the_motion(apple):
    reward = build_reward("motion_alignment")
    videos = clips(apple, ["left", "left", "growing"])
    got = reward(videos, ["a red apple moving left", "a red apple moving right", "a red apple growing"])
    # 32 px canvas, 12 px sprite: the corner moves 20 - 2 * 2 = 16 px = 0.5 of the frame; growth 0.5 -> 1x
    assert got[0].item() == pytest.approx(0.5, abs=0.02) and got[1].item() == pytest.approx(-0.5, abs=0.02)
    assert 0.7 < got[2].item() <= 1.0  # area ratio below 4: antialiased edges of the half-size sprite
    static = make_clip(apple, "left", 2, 32)[:1].expand(8, -1, -1, -1)[None].float() / 255
    assert reward(static, ["a red apple moving up"]).item() == 0.0
    blank = torch.ones(1, 4, 3, 16, 16)  # no sprite at all
    assert reward(blank, ["a red apple moving up"]).item() == -1.0
    assert math.isnan(reward(blank, ["a red apple"]).item())


def test_motion_displacement_is_the_signed_shift_along_the_named_direction(apple):
    reward = build_reward("motion_displacement")
    videos = clips(apple, list(MOTIONS))  # 32 px canvas, 12 px sprite: the corner moves 16 px = 0.5
    for want in MOTIONS[:4]:
        got = reward(videos, [motion_caption("red apple", want)] * len(MOTIONS))
        opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}[want]
        assert got[MOTIONS.index(want)].item() == pytest.approx(0.5, abs=1e-3), want
        assert got[MOTIONS.index(opposite)].item() == pytest.approx(-0.5, abs=1e-3), want
        for across in MOTIONS[:4]:  # motion across the axis is neither rewarded nor penalised
            if across not in (want, opposite):
                assert abs(got[MOTIONS.index(across)].item()) < 1e-4, (want, across)
    grow = reward(videos[4:], ["red apple growing"] * 2)
    assert grow[0].item() > 0.05 and grow[1].item() == pytest.approx(-grow[0].item(), abs=1e-6)
    static = make_clip(apple, "left", 2, 32)[:1].expand(8, -1, -1, -1)[None].float() / 255
    assert abs(reward(static, ["a red apple moving up"]).item()) < 1e-6
    # smooth: half the sprite's contrast still gives the same shift (no hard mask); a blank clip, or one
    # with a blank frame, is NaN for every kind of motion
    faded = 1 - 0.5 * (1 - videos[:1])
    assert reward(faded, ["red apple moving left"]).item() == pytest.approx(0.5, abs=1e-3)
    assert math.isnan(reward(torch.ones(1, 4, 3, 16, 16), ["a red apple moving up"]).item())
    gap = videos[4:5].clone()
    gap[:, -1] = 1.0
    assert math.isnan(reward(gap, ["red apple growing"]).item())
    # the floor: faint canvas noise (below 0.1) leaves the shift as it is; without the floor it shrinks
    noisy = (videos[:1] - 0.08 * torch.rand(videos[:1].shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert reward(noisy, ["red apple moving left"]).item() == pytest.approx(0.5, abs=0.02)
    unfloored = build_reward("motion_displacement", floor=0.0)(noisy, ["red apple moving left"]).item()
    assert unfloored < 0.4
    assert math.isnan(reward(videos[:1], ["a red apple"]).item())
