"""Guidance values are kept as given: ``guidance_scale: 0`` and ``1`` reach the trajectory as 0.0 and 1.0
(not read as "unset"), and the sampler's guided velocity moves away from the unconditional branch:
guided - cond has a positive projection on cond - uncond, (w - 1) |cond - uncond|^2 (Ho & Salimans 2022)."""

import pytest
import torch

from pretrain.config import load_config
from pretrain.schedule import sigma_schedule
from pretrain.text_encoder import PromptEmbeds
from rollout.config import RolloutConfig
from rollout.sampler import Sampler
from tests.distributed.common import CHANNELS, POOLED_DIM, SIZE, TEXT_DIM, TEXT_LEN, tiny_model

pytestmark = pytest.mark.core


class _Identity:
    """A codec whose images are the latents (enough for the sampler)."""

    @staticmethod
    def decode(x: torch.Tensor) -> torch.Tensor:
        return x


def _embeds(n: int, seed: int) -> PromptEmbeds:
    g = torch.Generator().manual_seed(seed)
    return PromptEmbeds(torch.randn(n, TEXT_LEN, TEXT_DIM, generator=g), torch.randn(n, POOLED_DIM, generator=g))


def _first_step(tmp_path, scale: str):
    """(trajectory, guided v of transition 0, v_cond, v_uncond) of a rollout with step type ``ode`` (so
    transition 0 is the Euler step x1 = x0 + (s1 - s0) v) whose config file says ``guidance_scale: scale``."""
    path = tmp_path / "rollout.yaml"
    path.write_text(f"guidance_scale: {scale}\nstep: ode\nnum_inference_steps: 4\n")
    cfg = load_config(RolloutConfig, path)
    model, cond, null = tiny_model().eval(), _embeds(2, 1), _embeds(1, 2)
    sigmas = sigma_schedule(4, 3.0)
    traj = Sampler(cfg, sigmas, null).sample(model, _Identity(), cond, ["a", "b"], group_ids=torch.tensor([0, 1]),
                                             sample_ids=[0, 1], latent_shape=(CHANNELS, SIZE, SIZE), seed=0,
                                             iteration=0, device="cpu")
    x0, x1 = traj.latents[:, 0], traj.latents[:, 1]
    v = (x1 - x0) / (sigmas[1] - sigmas[0])
    with torch.no_grad():
        s = sigmas[0].expand(2)
        v_cond, v_uncond = model(x0, s, cond), model(x0, s, PromptEmbeds(null.tokens.expand(2, -1, -1),
                                                                         null.pooled.expand(2, -1)))
    return traj, v, v_cond, v_uncond


def _check_direction(v, v_cond, v_uncond, w: float) -> None:
    """guided - cond projects positively on cond - uncond, by (w - 1) |cond - uncond|^2 per sample."""
    d = (v_cond - v_uncond).flatten(1)
    proj = ((v - v_cond).flatten(1) * d).sum(1)
    assert (proj > 0).all(), proj
    torch.testing.assert_close(proj, (w - 1) * d.pow(2).sum(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("given, want", [("0", 0.0), ("1", 1.0), ("0.0", 0.0), ("4.5", 4.5)])
def test_guidance_scale_is_recorded_as_given(tmp_path, given, want):
    traj, v, v_cond, v_uncond = _first_step(tmp_path, given)
    assert isinstance(traj.settings.guidance_scale, float) and traj.settings.guidance_scale == want
    assert (v_cond - v_uncond).abs().max() > 1e-3  # the two branches really differ
    guided = v_uncond + want * (v_cond - v_uncond)
    torch.testing.assert_close(v, guided, rtol=1e-4, atol=1e-5)  # w = 0: the uncond branch; w = 1: cond


def test_guided_minus_cond_projects_positively_on_cond_minus_uncond(tmp_path):
    _check_direction(*_first_step(tmp_path, "4.5")[1:], w=4.5)


def test_swapped_branches_fail_the_direction_check(tmp_path, monkeypatch):
    import pretrain.guidance as guidance

    real = guidance.cfg_branches
    monkeypatch.setattr(guidance, "cfg_branches", lambda *a: real(*a)[::-1])  # (uncond, cond)
    with pytest.raises(AssertionError):
        _check_direction(*_first_step(tmp_path, "4.5")[1:], w=4.5)
