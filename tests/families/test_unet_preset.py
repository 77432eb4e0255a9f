"""The UNet family's own pixel-space preset: an epsilon-prediction ``UNet2DConditionModel`` under a DDPM
schedule, trained with the ``epsilon`` objective, exported with its scheduler, sampled by our Euler ODE
sampler exactly as a diffusers DDIM (eta 0) loop, and post-trained with Flow-GRPO."""

import json

import pytest
import torch

from pretrain.export import ExportMeta, export_model, load_exported
from pretrain.models import ModelConfig, build_backbone
from pretrain.models.unet import UNET_SCHEDULER, UNetAdapter
from pretrain.objective import FlowConfig, draw_training_noise, objective_sigmas, pretrain_loss
from pretrain.sampling import sample_latents
from pretrain.text_encoder import PromptEmbeds
from tests.conftest import grpo_config, tiny_config

pytestmark = pytest.mark.core

SIZE, TEXT = 16, 384
UNET = ["model.arch=unet", "model.preset=tiny", "flow.objective=epsilon", "eval.shift=null"]


def _tiny(**overrides) -> UNetAdapter:
    torch.manual_seed(0)
    return build_backbone(ModelConfig(arch="unet", preset="tiny", overrides=overrides), SIZE, 3, TEXT, TEXT).eval()


def _embeds(n: int, seed: int) -> PromptEmbeds:
    g = torch.Generator().manual_seed(seed)
    return PromptEmbeds(torch.randn(n, 6, TEXT, generator=g), torch.randn(n, TEXT, generator=g))


def test_preset_builds_and_bad_values_raise_naming_the_key():
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from pretrain.config import ConfigError, load_config
    from pretrain.trainer import PretrainConfig

    model = _tiny()
    assert isinstance(model, UNetAdapter) and isinstance(model.transformer, UNet2DConditionModel)
    assert isinstance(model.schedule.scheduler, DDIMScheduler) and model.schedule.prediction_type == "epsilon"
    cfg = model.transformer.config
    assert (cfg.in_channels, cfg.out_channels, cfg.sample_size, cfg.cross_attention_dim) == (3, 3, SIZE, TEXT)
    table = model.train_sigmas()
    assert table.shape == (1000,) and torch.all(table[1:] > table[:-1])
    assert torch.equal(model.timestep(table), torch.arange(1000, dtype=torch.float32))  # each sigma maps back to t
    sigmas = model.sigmas(10)
    assert sigmas[-1] == 0 and model.timestep(sigmas[:-1]).tolist() == list(range(900, -1, -100))  # leading
    with pytest.raises(ValueError, match="shift must be null"):
        model.sigmas(10, shift=3.0)
    with pytest.raises(ValueError, match="model.preset: unknown preset 'huge'"):
        build_backbone(ModelConfig(arch="unet", preset="huge"), SIZE, 3, TEXT, TEXT)
    with pytest.raises(ValueError, match="data.size: sample size 17 is not divisible by 2"):
        build_backbone(ModelConfig(arch="unet", preset="tiny"), 17, 3, TEXT, TEXT)
    with pytest.raises(ValueError, match="model.overrides.scheduler: .*clip_sample"):
        _tiny(scheduler={"clip_sample": True})
    with pytest.raises(ValueError, match="model.overrides.scheduler: must be a mapping"):
        _tiny(scheduler="linear")
    assert _tiny(scheduler={"beta_schedule": "scaled_linear"}).export_settings()["scheduler"]["beta_schedule"] == \
        "scaled_linear"
    with pytest.raises(ConfigError, match="flow.objective: 'eps' is not one of"):
        load_config(PretrainConfig, None, ["model.arch=unet", "flow.objective=eps"])
    with pytest.raises(ConfigError, match="model.overrides: unknown field"):
        load_config(PretrainConfig, None, ["model.arch=unet", "model.overrides.channels=3"])
    sd3 = build_backbone(ModelConfig(preset="tiny"), SIZE, 3, TEXT, TEXT)
    with pytest.raises(ValueError, match="flow.objective: 'epsilon' draws the model's discrete training timesteps"):
        objective_sigmas(sd3, FlowConfig(objective="epsilon"))
    with pytest.raises(ValueError, match="UNetAdapter: adapter setting 'scheduler'"):
        UNetAdapter.from_settings(model.transformer, {})


def test_epsilon_objective_is_the_noise_mse_at_the_drawn_timesteps():
    model = _tiny()
    flow = FlowConfig(objective="epsilon", cond_dropout=0.0)
    table = objective_sigmas(model, flow)
    x0 = torch.rand(4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1)) * 2 - 1
    noise, sigma, drop = draw_training_noise(x0, 0, 0, range(4), flow, train_sigmas=table)
    again = draw_training_noise(x0, 0, 0, range(4), flow, train_sigmas=table)
    assert torch.equal(sigma, again[1]) and torch.equal(noise, again[0]) and not drop.any()
    t = torch.searchsorted(table, sigma)
    assert torch.equal(table[t], sigma)  # every drawn sigma is a training timestep's
    embeds, null = _embeds(4, 2), _embeds(1, 3)
    with torch.no_grad():
        ours = pretrain_loss(model, x0, embeds, null, noise, sigma, drop, "epsilon")
        # by hand, as DDPM / diffusers train: x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps at integer t
        abar = model.schedule.scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
        x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
        eps_hat = model.transformer(x_t, t, encoder_hidden_states=embeds.tokens).sample
        expected = (eps_hat - noise).square().mean()
        velocity = pretrain_loss(model, x0, embeds, null, noise, sigma, drop, "rectified_flow")
    print(f"\nepsilon objective at t={t.tolist()}: ours {ours.item():.7f}, by hand {expected.item():.7f}")
    assert abs(ours.item() - expected.item()) <= 1e-5 * expected.item() and expected > 0.1
    assert abs(velocity.item() - ours.item()) > 0.1  # the velocity loss is another number
    # the rectified-flow draw is untouched by the table
    rf = draw_training_noise(x0, 0, 0, range(4), FlowConfig(cond_dropout=0.0))
    assert torch.equal(rf[0], noise) and not torch.equal(rf[1], sigma)


def test_ode_sampler_is_a_ddim_loop_and_the_export_round_trips(tmp_path):
    from diffusers import DDIMScheduler

    from pretrain.codec import CodecConfig
    from pretrain.text_encoder import TextEncoderConfig

    model = _tiny()
    torch.manual_seed(4)
    for p in model.transformer.parameters():  # a random non-trivial net (fresh conv_out is small)
        p.data.add_(torch.randn_like(p) * 0.02)
    cond, null = _embeds(2, 5), _embeds(1, 6)
    noise = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    steps, scale = 8, 3.0
    ours = sample_latents(model, cond, null, noise, steps, scale, None)
    sch = DDIMScheduler.from_config(UNET_SCHEDULER)
    sch.set_timesteps(steps)
    x = noise * sch.init_noise_sigma
    with torch.no_grad():
        for t in sch.timesteps:
            both = model.transformer(torch.cat([x, x]), t, encoder_hidden_states=torch.cat(
                [null.tokens.expand(2, -1, -1), cond.tokens])).sample
            eps_u, eps_c = both.chunk(2)
            x = sch.step(eps_u + scale * (eps_c - eps_u), t, x, eta=0.0).prev_sample
    diff, big = (ours - x).abs().max().item(), x.abs().max().item()
    print(f"\nflow Euler over VPSchedule vs diffusers DDIM eta=0, {steps} steps: max diff {diff:.2e} (of {big:.2f})")
    assert diff <= 1e-5 * max(1.0, big) and big > 0.1

    out = export_model(model.transformer, tmp_path / "export", ExportMeta(
        TextEncoderConfig(), CodecConfig(), SIZE, {"num_inference_steps": steps, "guidance_scale": scale, "shift": None},
        "unet", adapter=model.export_settings(), objective="epsilon"))
    meta = json.loads((out / "posttrain.json").read_text())
    assert meta["adapter"]["scheduler"]["_class_name"] == "DDIMScheduler" and meta["objective"] == "epsilon"
    loaded, _, _, _ = load_exported(out)
    public = lambda config: {k: v for k, v in dict(config).items() if not k.startswith("_")}  # noqa: E731
    assert isinstance(loaded, UNetAdapter) and public(loaded.schedule.scheduler.config) == public(sch.config)
    assert torch.equal(loaded.sigmas(steps), model.sigmas(steps))
    x, s = noise, torch.tensor([0.3, 0.95])
    with torch.no_grad():
        assert torch.equal(loaded(x, s, cond), model(x, s, cond))


def test_pretrain_steps_export_and_one_grpo_iteration(tmp_path):
    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from pretrain.trainer import train

    export = train(tiny_config(tmp_path / "run", *UNET, "train.steps=2", "train.batch_size=8", "eval.every=2",
                               "eval.heldout_samples=8", "data.limit=64"))
    recs = read_metrics(tmp_path / "run/pretrain/metrics.jsonl")
    held = [r["heldout_loss"] for r in recs if "heldout_loss" in r]
    losses = [r["loss"] for r in recs if "loss" in r]
    print(f"\npretrain losses {losses}, held-out {held}")
    assert len(losses) == 2 and len(held) == 2 and all(0.2 < v < 3 for v in losses + held)  # eps MSE ~ 1 at init
    meta = json.loads((export / "posttrain.json").read_text())
    assert meta["arch"] == "unet" and meta["objective"] == "epsilon" and meta["sampling"]["shift"] is None
    assert meta["adapter"]["scheduler"]["beta_schedule"] == UNET_SCHEDULER["beta_schedule"] == "squaredcos_cap_v2"
    model, *_ = load_exported(export)
    assert isinstance(model, UNetAdapter)

    grpo_train(grpo_config(tmp_path / "run", export, "train.steps=1", "train.batch_size=16"))
    rec = read_metrics(tmp_path / "run/grpo/metrics.jsonl")[0]
    print(rec)
    assert abs(rec["ratio_min"] - 1) <= 1e-5 and abs(rec["ratio_max"] - 1) <= 1e-5, rec
    assert torch.isfinite(torch.tensor([rec["reward_mean"], rec["grad_norm"]])).all() and rec["grad_norm"] > 0
    post = json.loads((tmp_path / "run/grpo/export/posttrain.json").read_text())
    assert post["adapter"] == meta["adapter"] and post["objective"] == "epsilon"
    tuned, *_ = load_exported(tmp_path / "run/grpo/export")
    assert isinstance(tuned, UNetAdapter)
