"""The UNet family (SD 1.x / 2.x, SDXL) against diffusers on tiny random pipelines: our Euler ODE sampler
reproduces the pipelines' DDIM / Euler sampling, Diffusion-DPO runs on it, and its exports load back
into the pipelines."""

import math

import pytest
import torch

from pretrain.export import load_exported
from pretrain.models.unet.vp_schedule import VPSchedule
from pretrain.sampling import initial_noise, sample_latents
from tests.conftest import ROOT, dpo_config
from tests.families.tiny_unet_pipelines import SCALED_LINEAR, save_sd, save_sdxl, schedulers

pytestmark = pytest.mark.core

PROMPTS = ["a red apple", "a cat face"]
STEPS, GUIDANCE = 4, 3.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, sch = tmp_path_factory.mktemp("unet_pipes"), schedulers()
    return {"sd_ddim_eps": save_sd(root / "sd_ddim_eps", sch["ddim_eps"]),
            "sdxl_euler_eps": save_sdxl(root / "sdxl_euler_eps", sch["euler_eps"]),
            "sd_ddim_v": save_sd(root / "sd_ddim_v", sch["ddim_v"])}


def _pipeline(folder, meta, scheduler=None):
    import diffusers

    pipe = getattr(diffusers, meta["pipeline"]).from_pretrained(folder)
    if scheduler is not None:
        pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours_vs_pipeline(folder, pipe, options=None):
    """(latent max diff, image max diff, latent max abs, our images) of our sampler on
    ``load_exported(folder)`` vs ``pipe`` from the same initial noise."""
    model, encoder, codec, meta = load_exported(folder, options=options)
    size = meta["image_size"]
    noise = initial_noise(len(PROMPTS), codec.latent_shape(size, size), seed=0)
    ours = sample_latents(model, encoder.encode(PROMPTS), encoder.encode([""]), noise, STEPS, GUIDANCE, None)
    kw = dict(latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=size, width=size)
    theirs = pipe(PROMPTS, output_type="latent", **kw).images
    images = pipe(PROMPTS, output_type="pt", **kw).images
    ours_img = codec.decode(ours)
    return (ours - theirs).abs().max().item(), (ours_img - images).abs().max().item(), ours.abs().max().item(), ours_img


@pytest.mark.parametrize("name", ["ddim_eps", "euler_eps", "ddim_v"])
def test_schedule_walks_the_scheduler_timesteps(name):
    sch = schedulers()[name]
    schedule = VPSchedule(sch)
    sigmas = schedule.sigmas(STEPS)
    sch.set_timesteps(STEPS)
    assert sigmas[-1] == 0 and sigmas.dtype == torch.float32 and len(sigmas) == STEPS + 1
    assert torch.equal(schedule.timestep(sigmas[:-1]), sch.timesteps.float())
    ac = sch.alphas_cumprod.double()[sch.timesteps.long()]
    expected = (1 - ac).sqrt() / ((1 - ac).sqrt() + ac.sqrt())  # s / (alpha + s)
    assert (sigmas[:-1].double() - expected).abs().max() < 1e-6


def test_karras_sigmas_map_back_to_the_scheduler_timesteps():
    from diffusers import EulerDiscreteScheduler

    sch = EulerDiscreteScheduler(**SCALED_LINEAR, use_karras_sigmas=True)
    schedule = VPSchedule(sch)
    sigmas = schedule.sigmas(6)
    sch.set_timesteps(6)
    ve = sch.sigmas[:-1].double()
    assert (sigmas[:-1].double() - ve / (1 + ve)).abs().max() < 1e-6
    diff = (schedule.timestep(sigmas[:-1]) - sch.timesteps.float()).abs().max().item()
    print(f"\nkarras timesteps: max |ours - scheduler| = {diff:.2e}")
    assert diff < 1e-2  # fractional timesteps, float32 sigmas


def test_unsupported_schedulers_raise_and_the_scheduler_option_replaces_them(tmp_path):
    from diffusers import DDIMScheduler, PNDMScheduler

    with pytest.raises(ValueError, match="PNDMScheduler is not supported.*DDIMScheduler, EulerDiscreteScheduler"):
        VPSchedule(PNDMScheduler(**SCALED_LINEAR))
    with pytest.raises(ValueError, match="set_alpha_to_one=False"):
        VPSchedule(DDIMScheduler(**SCALED_LINEAR, clip_sample=False, set_alpha_to_one=False))
    with pytest.raises(ValueError, match="clip_sample"):
        VPSchedule(DDIMScheduler(**SCALED_LINEAR))
    with pytest.raises(ValueError, match="not an Euler walk"):
        VPSchedule(DDIMScheduler(**SCALED_LINEAR, clip_sample=False, timestep_spacing="linspace")).sigmas(STEPS)
    # an SD 1.5-style folder (PNDM, set_alpha_to_one False) samples with DDIM when asked to
    folder = save_sd(tmp_path / "pndm", PNDMScheduler(**SCALED_LINEAR, set_alpha_to_one=False, skip_prk_steps=True,
                                                      steps_offset=1))
    with pytest.raises(ValueError, match="PNDMScheduler"):
        load_exported(folder)
    _, _, _, meta = load_exported(folder, options={"scheduler": "ddim"})
    pipe = _pipeline(folder, meta)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, set_alpha_to_one=True, clip_sample=False)
    d_lat, d_img, scale, _ = _ours_vs_pipeline(folder, pipe, {"scheduler": "ddim"})
    print(f"\nPNDM folder sampled with DDIM: max |ours - pipeline| latents {d_lat:.2e} (of {scale:.2f}), images {d_img:.2e}")
    assert d_lat < 1e-5 * max(1.0, scale) and d_img < 1e-5
    # its export carries the DDIM scheduler it sampled with; the source folder keeps its PNDM
    from diffusers import StableDiffusionPipeline

    from pretrain.models.pipelines import export_pipeline

    model, _, _, meta = load_exported(folder, options={"scheduler": "ddim"})
    out = export_pipeline(model.transformer, meta, tmp_path / "export")
    assert type(StableDiffusionPipeline.from_pretrained(out).scheduler).__name__ == "DDIMScheduler"
    assert type(StableDiffusionPipeline.from_pretrained(folder).scheduler).__name__ == "PNDMScheduler"
    assert load_exported(out)[3]["options"] == {"scheduler": "ddim"}


@pytest.mark.parametrize("name", ["sd_ddim_eps", "sdxl_euler_eps", "sd_ddim_v"])
def test_sampler_reproduces_the_pipeline(folders, name):
    folder = folders[name]
    model, encoder, _, meta = load_exported(folder)
    pipe = _pipeline(folder, meta)
    assert meta["family"] == "unet" and meta["component"] == "unet" and meta["image_size"] == 32
    assert meta["sampling"]["guidance_scale"] == (5.0 if "sdxl" in name else 7.5)
    # prompt embeddings are the pipeline's encode_prompt; "" is its negative embedding
    out = pipe.encode_prompt(prompt=PROMPTS, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True)
    ours, null = encoder.encode(PROMPTS), encoder.encode([""])
    assert torch.equal(ours.tokens, out[0]) and torch.equal(null.tokens, out[1][:1])
    if "sdxl" in name:
        assert torch.equal(ours.pooled, out[2]) and torch.equal(null.pooled, out[3][:1])
        assert null.tokens.abs().max() == 0  # force_zeros_for_empty_prompt
    else:
        assert ours.pooled.shape == (2, 0)
    d_lat, d_img, scale, _ = _ours_vs_pipeline(folder, pipe)
    print(f"\n{name}: max |ours - {meta['pipeline']}| latents {d_lat:.2e} (of {scale:.2f}), images {d_img:.2e}")
    assert d_lat < 1e-5 * max(1.0, scale) and d_img < 1e-5


@pytest.mark.parametrize("name", ["sdxl_euler_eps", "sd_ddim_eps"])
def test_dpo_step_and_exports_load_in_the_pipeline(folders, name, tmp_path):
    from safetensors.torch import load_file

    from posttrain.dpo.stage import train
    from pretrain.runtime.metrics import read_metrics

    folder = folders[name]
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/train.txt").write_text("a red apple\na cat face\na flag\nthe moon\n")
    (tmp_path / "prompts/test.txt").write_text("a red face\n")
    export = train(dpo_config(
        tmp_path, folder, "data.source=prompts", f"data.path={tmp_path / 'prompts'}", "train.steps=1",
        "online.resample_every=1", "checkpoint.every=0", "online.prompts_per_round=2", "online.samples_per_prompt=2",
        "online.num_inference_steps=2", "train.batch_size=2", "eval.grid_prompts=1", "eval.num_inference_steps=2",
        "dpo.error_space=noise", "dpo.beta=5000", "optim.lr=0.05"))
    rec = read_metrics(tmp_path / "dpo/metrics.jsonl")[-1]
    print(f"\n{name} DPO step 1: loss {rec['loss']:.7f} (log 2 = {math.log(2):.7f}), reward margin "
          f"{rec['reward_margin']}, err diffs {rec['err_diff_w']}, {rec['err_diff_l']}, grad norm {rec['grad_norm']:.3g}")
    # LoRA B = 0 at step 1: the policy is the reference, every inside term is exactly 0
    assert rec["reward_margin"] == 0.0 and rec["err_diff_w"] == 0.0 and rec["err_diff_l"] == 0.0
    assert abs(rec["loss"] - math.log(2)) < 1e-6 and math.isfinite(rec["grad_norm"]) and rec["grad_norm"] > 0
    lora_dir = tmp_path / "dpo/lora"
    lora = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    assert lora and all(k.startswith("unet.") for k in lora)
    assert max(v.abs().max().item() for k, v in lora.items() if "lora_B" in k) > 0  # the step moved the policy

    _, _, _, meta = load_exported(export)
    d_lat, d_img, scale, ours = _ours_vs_pipeline(export, _pipeline(export, meta))
    base = _pipeline(folder, meta)
    _, _, _, ours_base = _ours_vs_pipeline(folder, base)
    base.load_lora_weights(str(lora_dir))
    _, d_lora, _, _ = _ours_vs_pipeline(export, base)
    moved = (ours - ours_base).abs().max().item()
    print(f"{name} export: max |ours - pipeline(export)| latents {d_lat:.2e} (of {scale:.2f}), images {d_img:.2e}; "
          f"pipeline(source) + load_lora_weights vs ours(export) images {d_lora:.2e}; export vs source images {moved:.2e}")
    assert d_lat < 1e-5 * max(1.0, scale) and d_img < 1e-5 and d_lora < 1e-5
    assert moved > 1e-3  # the checks above could fail: the DPO step changed the images


def test_sdxl_dpo_config_loads(folders):
    from posttrain.dpo.stage import DPOConfig
    from pretrain.config import ConfigError, load_config

    path = ROOT / "configs/dpo/sdxl.yaml"
    with pytest.raises(ConfigError, match="model.pretrained"):
        load_config(DPOConfig, path)
    cfg = load_config(DPOConfig, path, [f"model.pretrained={folders['sdxl_euler_eps']}"])
    assert cfg.model.options["image_size"] == 1024 and cfg.dpo.beta == 5000 and cfg.dpo.error_space == "noise"
    assert cfg.source == "offline" and cfg.offline.path


@pytest.mark.parametrize("name", ["sd_ddim_eps", "sd_ddim_v"])
def test_ddpo_ddim_step_ratio_is_one_on_sd_folders(folders, name):
    """DDPO's sampler (the ``ddim`` step, eta 1) on an SD folder predicting epsilon or v: rollout batch 4,
    every transition recomputed one sample at a time gives ratio 1 before any update."""
    from rollout.config import RolloutConfig
    from rollout.sampler import Sampler, log_prob

    model, encoder, codec, meta = load_exported(folders[name])
    cfg = RolloutConfig(step="ddim", noise_level=1.0, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                        group_size=2, batch_size=4)
    sampler = Sampler.build(cfg, model, encoder, "cpu", None)
    size = meta["image_size"]
    traj = sampler.sample(model, codec, encoder.encode([p for p in PROMPTS for _ in range(2)]), PROMPTS * 2,
                          group_ids=torch.tensor([0, 0, 1, 1]), sample_ids=[0, 1, 2, 3],
                          latent_shape=codec.latent_shape(size, size), seed=0, iteration=0, device="cpu")
    assert (traj.log_probs[:, :-1] != 0).all() and (traj.log_probs[:, -1] == 0).all()  # the step to sigma 0
    worst = 0.0
    with torch.no_grad():
        for i in range(4):
            mb = traj.select(torch.tensor([i]))
            for t in range(STEPS):
                worst = max(worst, float((torch.exp(log_prob(model, mb, t).log_prob - mb.log_probs[:, t]) - 1).abs()))
    assert worst <= 1e-5, worst
