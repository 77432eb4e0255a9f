"""The sampler owns its settings: a trajectory records what it was sampled with (step type, schedule,
timesteps, noise level, guidance, negative prompt) and the recomputation reads them back."""

import dataclasses

import pytest
import torch

from pretrain.schedule import sigma_schedule
from rollout.config import RolloutConfig
from rollout.sampler import Sampler, log_prob
from rollout.trajectory import Trajectory
from tests.integration.test_grpo import STEPS, _setup


def _sampler(model, encoder, **kw):
    cfg = RolloutConfig(num_inference_steps=STEPS, group_size=2, batch_size=4, shift=3.0, **kw)
    return Sampler.build(cfg, model, encoder, "cpu", shift=1.0)  # cfg.shift wins over the export's


def test_trajectory_records_its_settings_and_recomputes_from_them(tiny_export):
    from pretrain.export import load_exported

    model, codec, train, null, policy, meta = _setup(tiny_export)
    _, encoder, _, _ = load_exported(tiny_export)
    shape = (codec.channels, meta["image_size"], meta["image_size"])
    model.eval()
    trajs = {}
    for negative in ("", "a blurry photo"):
        s = _sampler(model, encoder, noise_level=0.5, guidance_scale=3.0, negative_prompt=negative)
        trajs[negative] = t = s.rollout(model, codec, train, [0, 1], latent_shape=shape, seed=0, iteration=0,
                                        device="cpu")
        st = t.settings
        assert (st.step, st.noise_level, st.guidance_scale, st.negative_prompt) == ("sde", 0.5, 3.0, negative)
        assert torch.equal(st.sigmas, sigma_schedule(STEPS, 3.0)) and st.timesteps.shape == (STEPS,)
        assert torch.equal(st.timesteps, st.sigmas[:-1] * 1000)  # SD3's convention, what the denoiser received
        assert torch.equal(st.negative.tokens, encoder.encode([negative]).tokens)
        with torch.no_grad():  # read back from the trajectory: the ratio is 1 whatever the defaults are
            for k in range(STEPS):
                assert (log_prob(model, t, k).log_prob - t.log_probs[:, k]).abs().max() <= 1e-5
    # the negative prompt changes the samples, so a recomputation with the wrong one would not match
    a, b = trajs[""], trajs["a blurry photo"]
    assert (a.latents[:, -1] - b.latents[:, -1]).abs().max() > 1e-3
    swapped = dataclasses.replace(b, settings=a.settings)
    with torch.no_grad():
        assert (log_prob(model, swapped, 2).log_prob - b.log_probs[:, 2]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="different settings"):
        Trajectory.cat([a, b])


def test_unknown_step_type_names_the_key():
    with pytest.raises(ValueError, match=r"rollout\.step: unknown step type 'ddim'; known: \['cps', 'sde'\]"):
        RolloutConfig(step="ddim").validate("rollout.")
    with pytest.raises(ValueError, match=r"rollout\.noise_level: step 'cps' takes at most 1.0, got 1.5"):
        RolloutConfig(step="cps", noise_level=1.5).validate("rollout.")


@pytest.mark.parametrize("step", ["sde", "cps"])
def test_ratio_is_one_before_any_update_for_every_step_type(tiny_export, step):
    from pretrain.export import load_exported

    model, codec, train, null, policy, meta = _setup(tiny_export)  # LoRA B != 0: policy differs from reference
    _, encoder, _, _ = load_exported(tiny_export)
    shape = (codec.channels, meta["image_size"], meta["image_size"])
    model.eval()
    traj = _sampler(model, encoder, step=step, noise_level=0.8, guidance_scale=3.0).rollout(
        model, codec, train, [0, 1], latent_shape=shape, seed=0, iteration=0, device="cpu")  # rollout batch 4
    assert traj.settings.step == step and (traj.log_probs[:, :-1] != 0).all()
    model.train()
    worst = 0.0
    with torch.enable_grad():
        for i in range(len(traj)):  # training batch 1
            mb = traj.select(torch.tensor([i]))
            for t in range(STEPS):
                ratio = torch.exp(log_prob(model, mb, t).log_prob - mb.log_probs[:, t])
                worst = max(worst, (ratio - 1).abs().max().item())
    assert worst <= 1e-5, (step, worst)


def test_grpo_trains_with_the_cps_step(tiny_export, tmp_path):
    from posttrain.grpo import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import grpo_config

    # one optimizer step per iteration: every ratio is measured before the update
    grpo_train(grpo_config(tmp_path, tiny_export, "rollout.step=cps", "rollout.noise_level=0.8", "train.steps=1",
                           "train.batch_size=16"))
    rec = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    assert rec["ratio_min"] > 1 - 1e-5 and rec["ratio_max"] < 1 + 1e-5 and rec["grad_norm"] > 0
    assert (tmp_path / "grpo/export/posttrain.json").is_file()
