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

pytestmark = pytest.mark.core


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
    with pytest.raises(ValueError, match=r"rollout\.step: unknown step type 'ddpm'; known: \['cps', 'ddim', 'ode', 'sde'\]"):
        RolloutConfig(step="ddpm").validate("rollout.")
    with pytest.raises(ValueError, match=r"rollout\.noise_level: step 'cps' takes at most 1.0, got 1.5"):
        RolloutConfig(step="cps", noise_level=1.5).validate("rollout.")
    with pytest.raises(ValueError, match=r"rollout\.noise_level: step 'ddim' takes at most 1.0, got 1.2"):
        RolloutConfig(step="ddim", noise_level=1.2).validate("rollout.")


@pytest.mark.parametrize("step", ["sde", "cps", "ddim"])
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
    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import grpo_config

    # one optimizer step per iteration: every ratio is measured before the update
    grpo_train(grpo_config(tmp_path, tiny_export, "rollout.step=cps", "rollout.noise_level=0.8", "train.steps=1",
                           "train.batch_size=16"))
    rec = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    assert rec["ratio_min"] > 1 - 1e-5 and rec["ratio_max"] < 1 + 1e-5 and rec["grad_norm"] > 0
    assert (tmp_path / "grpo/export/posttrain.json").is_file()


def test_sde_window_outside_is_deterministic_and_untrained(tiny_export):
    from pretrain.export import load_exported
    from rollout.window import WindowConfig

    model, codec, train, null, policy, meta = _setup(tiny_export)
    _, encoder, _, _ = load_exported(tiny_export)
    shape = (codec.channels, meta["image_size"], meta["image_size"])
    model.eval()
    run = dict(latent_shape=shape, seed=0, iteration=0, device="cpu")
    plain = _sampler(model, encoder).rollout(model, codec, train, [0, 1], **run)
    full = _sampler(model, encoder, sde_window=WindowConfig(size=STEPS)).rollout(model, codec, train, [0, 1], **run)
    assert torch.equal(full.latents, plain.latents) and torch.equal(full.log_probs, plain.log_probs)  # bitwise
    sampler = _sampler(model, encoder, sde_window=WindowConfig(size=2, start=2))
    traj = sampler.rollout(model, codec, train, [0, 1], **run)
    assert traj.settings.window == (2, 4) and sampler.train_transitions(0, 0) == [2, 3]
    assert (traj.log_probs[:, [0, 1, 4, 5]] == 0).all() and (traj.log_probs[:, 2:4] != 0).all()
    assert torch.equal(traj.latents[:, 0], plain.latents[:, 0])  # the same initial noise
    later = _sampler(model, encoder, sde_window=WindowConfig(size=2, start=4)).rollout(model, codec, train, [0, 1],
                                                                                       **run)
    assert torch.equal(traj.latents[:, :3], later.latents[:, :3])  # deterministic before either window
    assert not torch.equal(traj.latents[:, 3], later.latents[:, 3])
    with torch.no_grad():
        for t in range(STEPS):  # recomputed from the recorded window: ratio 1 inside, log-prob 0 outside
            assert (log_prob(model, traj, t).log_prob - traj.log_probs[:, t]).abs().max() <= 1e-5, t
        with pytest.raises(ValueError, match="mix the SDE window"):
            log_prob(model, traj, [1, 2])


def test_window_modes_move_as_configured():
    from rollout.window import WindowConfig

    fast = WindowConfig(size=3, min_size=1, mode="random", start=0, end=5)  # Flow-GRPO-Fast: 1-3 steps, first half
    seen = {fast.bounds(10, 0, it) for it in range(200)}
    assert all(0 <= lo < hi <= 5 and 1 <= hi - lo <= 3 for lo, hi in seen) and len(seen) > 5
    assert fast.bounds(10, 0, 7) == fast.bounds(10, 0, 7)  # keyed by (seed, iteration): a resume redraws it
    mix = WindowConfig(size=4, mode="progressive", every=25, end=25)  # MixGRPO: 4 of 25, moved every 25
    assert [mix.bounds(25, 0, it) for it in (0, 24, 25, 50, 21 * 25, 22 * 25)] == [
        (0, 4), (0, 4), (1, 5), (2, 6), (21, 25), (0, 4)]
    with pytest.raises(ValueError, match=r"rollout\.sde_window\.size: a window of 4 from start 8"):
        RolloutConfig(num_inference_steps=10, sde_window=WindowConfig(size=4, start=8)).validate("rollout.")


def test_a_window_covering_every_transition_is_plain_flow_grpo(tiny_export, tmp_path):
    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import grpo_config

    recs = {}
    for name, extra in (("plain", []), ("window", ["rollout.sde_window.size=6"])):
        grpo_train(grpo_config(tmp_path / name, tiny_export, "rollout.timestep_fraction=1.0", "train.steps=2", *extra))
        recs[name] = [{k: v for k, v in r.items() if not k.startswith(("time_", "samples_per_s", "peak_rss"))}
                      for r in read_metrics(tmp_path / name / "grpo/metrics.jsonl")]
    assert recs["window"] == recs["plain"] and len(recs["plain"]) == 2


def test_ode_solver_after_the_window_leaves_the_window_and_its_log_probs_alone(tiny_export):
    from pretrain.export import load_exported
    from pretrain.guidance import guided_velocity
    from rollout.dpm_solver import dpmpp_2m_update, flow_data_prediction
    from rollout.window import WindowConfig

    model, codec, train, null, policy, meta = _setup(tiny_export)
    _, encoder, _, _ = load_exported(tiny_export)
    shape = (codec.channels, meta["image_size"], meta["image_size"])
    model.eval()
    run = dict(latent_shape=shape, seed=0, iteration=0, device="cpu")

    def rollout(solver, window):
        return _sampler(model, encoder, sde_window=window, ode_solver=solver).rollout(model, codec, train, [0, 1],
                                                                                        **run)

    full = {s: rollout(s, WindowConfig(size=STEPS)) for s in ("euler", "dpmpp_2m")}  # nothing after the window
    assert torch.equal(full["dpmpp_2m"].latents, full["euler"].latents)
    assert torch.equal(full["dpmpp_2m"].log_probs, full["euler"].log_probs)
    window = WindowConfig(size=2, start=1)  # transitions 1, 2 stochastic; 3, 4, 5 after the window
    euler, dpm = rollout("euler", window), rollout("dpmpp_2m", window)
    assert (euler.settings.ode_solver, dpm.settings.ode_solver) == ("euler", "dpmpp_2m")
    assert torch.equal(dpm.latents[:, :4], euler.latents[:, :4])  # before and inside the window: unchanged
    assert torch.equal(dpm.log_probs, euler.log_probs) and (dpm.log_probs[:, 3:] == 0).all()
    assert (dpm.latents[:, -1] - euler.latents[:, -1]).abs().max() > 1e-4
    with torch.no_grad():  # training recomputes the window's transitions from the recorded latents: ratio 1
        for traj in (euler, dpm):
            for t in (1, 2):
                assert (log_prob(model, traj, t).log_prob - traj.log_probs[:, t]).abs().max() <= 1e-5, t
        # each transition after the window is DPM-Solver++(2M) from the recorded states, history included
        sig, embeds, neg = dpm.sigmas, dpm.embeds, dpm.settings.negative

        def v(t):
            return guided_velocity(model, dpm.latents[:, t], sig[t].expand(len(dpm)), embeds, neg,
                                   dpm.settings.guidance_scale)

        for t in (3, 4, 5):
            x, xp = dpm.latents[:, t], dpm.latents[:, t - 1]
            want = dpmpp_2m_update(x, flow_data_prediction(x, v(t), sig[t]), sig[t], sig[t + 1],
                                   flow_data_prediction(xp, v(t - 1), sig[t - 1]), sig[t - 1])
            assert (dpm.latents[:, t + 1] - want).abs().max() <= 1e-5, t
    with pytest.raises(ValueError, match="different settings"):
        Trajectory.cat([euler, dpm])


def test_ode_solver_is_checked_and_needs_a_window():
    from rollout.window import WindowConfig

    with pytest.raises(ValueError, match=r"rollout\.ode_solver: unknown ODE solver 'heun'; known: \['dpmpp_2m', "):
        RolloutConfig(ode_solver="heun", sde_window=WindowConfig(size=2)).validate("rollout.")
    with pytest.raises(ValueError, match=r"rollout\.ode_solver: 'dpmpp_2m' takes the transitions after an sde_window"):
        RolloutConfig(ode_solver="dpmpp_2m").validate("rollout.")
    RolloutConfig(ode_solver="dpmpp_2m", sde_window=WindowConfig(size=2)).validate("rollout.")
