"""SD3 / SD3.5 family (pretrain.models.sd3) against diffusers' StableDiffusion3Pipeline on a tiny
randomly initialised pipeline folder: sampling, the ratio == 1 invariant, a GRPO run and its exports."""

from pathlib import Path

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import sample_latents

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red apple", "the flag of a cat"]
SIZE, STEPS, SCALE, NOISE, TOL = 32, 4, 4.5, 0.7, 1e-5


def tiny_clip(tokenizer):
    """A random 2-layer ``CLIPTextModelWithProjection`` (width 16, projection 16) for ``tokenizer``."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=16))


def save_tiny_sd3(path: Path) -> Path:
    """A tiny StableDiffusion3Pipeline (SD3.5-style transformer: dual attention in block 0, RMS qk-norm;
    16-channel VAE with 2x downsampling; two CLIP + T5) saved with ``save_pretrained``."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import T5Config, T5EncoderModel

    from tests.families.tiny_tokenizers import clip_tokenizer, t5_tokenizer

    torch.manual_seed(0)
    clip_tok = clip_tokenizer()
    clip = lambda: tiny_clip(clip_tok)  # noqa: E731
    t5 = T5EncoderModel(T5Config(vocab_size=100, d_model=48, d_ff=64, d_kv=8, num_layers=2, num_heads=2,
                                 relative_attention_num_buckets=8, decoder_start_token_id=0))
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=48, caption_projection_dim=16, pooled_projection_dim=32,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=16, norm_num_groups=4, sample_size=SIZE, scaling_factor=1.5305,
                        shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(), tokenizer=clip_tok, text_encoder_2=clip(), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5, tokenizer_3=t5_tokenizer())
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipe")


def diffusers_pipe(path, lora=None):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def pipeline_images(pipe, noise, scale=SCALE, **kw):
    """(latents, images in [0, 1]) of ``pipe`` from the initial latents ``noise``."""
    args = dict(prompt=PROMPTS, num_inference_steps=STEPS, guidance_scale=scale, height=SIZE, width=SIZE, **kw)
    with torch.no_grad():
        lat = pipe(latents=noise.clone(), output_type="latent", **args).images
        img = pipe(latents=noise.clone(), output_type="pt", **args).images
    return lat, img


def our_images(path, noise, scale=SCALE):
    model, encoder, codec, meta = load_exported(path)
    lat = sample_latents(model.eval(), encoder.encode(PROMPTS), encoder.encode([""]), noise, STEPS, scale, shift=None)
    return lat, codec.decode(lat), meta


def initial_noise(channels=16):
    return torch.randn(len(PROMPTS), channels, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(1))


def test_load_meta_sigmas_and_embeddings(folder):
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    model, encoder, codec, meta = load_exported(folder)
    assert meta == {"family": "sd3", "pipeline": "StableDiffusion3Pipeline", "component": "transformer",
                    "source": str(folder), "image_size": SIZE, "options": {},
                    "sampling": {"num_inference_steps": 28, "guidance_scale": 7.0, "shift": None}}
    assert codec.latent_shape(SIZE, SIZE) == (16, SIZE // 2, SIZE // 2)
    assert encoder.dim == 48 and encoder.pooled_dim == 32
    pipe = diffusers_pipe(folder)
    for n in (1, 4, 28):
        retrieve_timesteps(pipe.scheduler, n, "cpu")
        ours = model.sigmas(n)
        assert ours.dtype == torch.float32 and ours.shape == (n + 1,) and ours[-1] == 0
        assert torch.equal(ours, pipe.scheduler.sigmas), n
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=1.5)  # a shift override
    retrieve_timesteps(pipe.scheduler, 4, "cpu")
    assert torch.equal(model.sigmas(4, shift=1.5), pipe.scheduler.sigmas)
    with torch.no_grad():
        tokens, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=True)
    cond, null = encoder.encode(PROMPTS), encoder.encode([""])
    assert cond.tokens.shape == (2, 77 + 256, 48) and cond.pooled.shape == (2, 32)
    assert torch.equal(cond.tokens, tokens) and torch.equal(cond.pooled, pooled)
    null2 = encoder.encode(["", ""])  # the pipeline's unconditional batch, same batch size: bitwise equal
    assert torch.equal(null2.tokens, neg) and torch.equal(null2.pooled, neg_pooled)
    assert null.tokens.shape == (1, 77 + 256, 48)  # batch 1: equal up to float rounding of the batched matmuls
    assert max((null.tokens[0] - neg[0]).abs().max(), (null.pooled[0] - neg_pooled[0]).abs().max()) <= 1e-6
    assert not torch.equal(null.tokens[0], cond.tokens[0])
    other = load_exported(folder, options={"max_sequence_length": 32})[1]
    assert other.cache_key != encoder.cache_key and "/" not in encoder.cache_key
    with pytest.raises(ValueError, match="image_size"):
        load_exported(folder, options={"image_size": 30})
    with pytest.raises(ValueError, match="unknown"):
        load_exported(folder, options={"guidance": 3.0})


def test_bfloat16_option(folder):
    model, encoder, codec, meta = load_exported(folder, options={"dtype": "bfloat16", "max_sequence_length": 8})
    ref_model, ref_encoder = load_exported(folder, options={"max_sequence_length": 8})[:2]
    assert next(model.transformer.parameters()).dtype == torch.bfloat16 and codec.vae.dtype == torch.bfloat16
    assert encoder.cache_key != ref_encoder.cache_key and meta["options"]["dtype"] == "bfloat16"
    embeds = encoder.encode(PROMPTS)
    assert embeds.tokens.dtype == torch.float32 and embeds.tokens.shape == (2, 77 + 8, 48)
    x, sigma = initial_noise(), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v, want = model(x, sigma, embeds), ref_model(x, sigma, ref_encoder.encode(PROMPTS))
    assert v.dtype == torch.float32 and (v - want).abs().max() < 0.05 * want.abs().max()


def test_ode_sampling_matches_the_diffusers_pipeline(folder, capsys):
    noise = initial_noise()
    lat, img, _ = our_images(folder, noise)
    want_lat, want_img = pipeline_images(diffusers_pipe(folder), noise)
    d_lat, d_img = (lat - want_lat).abs().max().item(), (img - want_img).abs().max().item()
    with capsys.disabled():
        print(f"\nsd3 ODE vs StableDiffusion3Pipeline: max |latents diff| {d_lat:.2e}, max |image diff| {d_img:.2e}")
    assert img.shape == (2, 3, SIZE, SIZE) and img.dtype == torch.float32
    assert d_lat <= TOL and d_img <= TOL
    assert (img[0] - img[1]).abs().max() > 1e-3  # the prompts really condition the sample


def test_schedule_option_pipeline_by_default_or_shifted_once(folder, capsys):
    import numpy as np
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    default = load_exported(folder)[0]
    single, encoder, codec, meta = load_exported(folder, options={"schedule": "single_shift"})
    assert meta["options"] == {"schedule": "single_shift"}  # recorded: an export of a run walks it again
    pipe = diffusers_pipe(folder)  # the fixture's scheduler: shift 3, no dynamic shifting
    retrieve_timesteps(pipe.scheduler, 10, "cpu")
    assert torch.equal(default.sigmas(10), pipe.scheduler.sigmas)  # the default: what the pipeline walks
    retrieve_timesteps(pipe.scheduler, None, "cpu", sigmas=np.linspace(1.0, 1 / 1000, 10))
    assert torch.equal(single.sigmas(10), pipe.scheduler.sigmas)  # the pipeline given the unshifted sigmas
    assert abs(default.sigmas(10)[-2].item() - 1 / 112) < 1e-7 and abs(single.sigmas(10)[-2].item() - 1 / 334) < 1e-7
    # our ODE on the single-shift schedule equals the pipeline called with those sigmas
    noise = initial_noise()
    lat = sample_latents(single.eval(), encoder.encode(PROMPTS), encoder.encode([""]), noise, STEPS, SCALE,
                         shift=None)
    want_lat, want_img = pipeline_images(pipe, noise, sigmas=np.linspace(1.0, 1 / 1000, STEPS))
    d_lat, d_img = (lat - want_lat).abs().max().item(), (codec.decode(lat) - want_img).abs().max().item()
    with capsys.disabled():
        print(f"\nsd3 single_shift ODE vs StableDiffusion3Pipeline(sigmas=...): max |latents diff| {d_lat:.2e}, "
              f"max |image diff| {d_img:.2e}")
    assert d_lat <= TOL and d_img <= TOL
    with pytest.raises(ValueError, match=r"model\.options\.schedule: 'double'"):
        load_exported(folder, options={"schedule": "double"})


def lora_rollout(folder: Path):
    """The tiny model with a perturbed LoRA policy (train mode), the policy, and a rollout of 4 samples
    (2 prompts x group 2, in batches of 3 + 1)."""
    from pretrain.data.dataset import DataConfig, build_datasets
    from tests.conftest import sampler_rollout
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, meta = load_exported(folder, options={"max_sequence_length": 32})
    train, _ = build_datasets(DataConfig(size=meta["image_size"], limit=8), encoder)
    null = encoder.encode([""])
    policy = perturbed_lora_policy(model)
    model.eval()
    traj = sampler_rollout(model, codec, train, [0, 1], group=2, batch=3, null=null, sigmas=model.sigmas(STEPS),
                           noise=NOISE, scale=SCALE, latent_shape=codec.latent_shape(SIZE, SIZE))
    return model.train(), policy, traj


def test_rollout_log_probs_recomputed_in_training_equal(folder, capsys):
    from rollout.sampler import log_prob

    model, policy, traj = lora_rollout(folder)
    d_logp = d_ratio = 0.0
    with torch.enable_grad():
        for start in (0, 2):  # mini-batches of 2, not the rollout's
            mb = traj.select(torch.arange(start, start + 2))
            for t in range(STEPS):
                new = log_prob(model, mb, t).log_prob  # the default branches detach the unconditional one
                d_logp = max(d_logp, (new - mb.log_probs[:, t]).abs().max().item())
                d_ratio = max(d_ratio, (torch.exp(new - mb.log_probs[:, t]) - 1).abs().max().item())
        with torch.no_grad(), policy.reference() as ref:  # the metric sees a different policy
            d_ref = (log_prob(ref, mb, 0).log_prob - mb.log_probs[:, 0]).abs().max()
    with capsys.disabled():
        print(f"\nsd3 rollout vs training recomputation over {STEPS} transitions: max |log_prob diff| {d_logp:.2e}, "
              f"max |ratio - 1| {d_ratio:.2e} (reference policy: {d_ref:.2e})")
    assert torch.isfinite(traj.log_probs).all() and d_logp <= TOL and d_ratio <= TOL
    assert d_ref > 10 * TOL, d_ref.item()  # the reference (adapters off) gives other log-probs


@pytest.mark.long
def test_gpu_preset_compiled_blocks_give_eager_log_probs_and_gradients(folder, capsys):
    from tests.families.compiled import assert_compiled_matches_eager

    model, _, traj = lora_rollout(folder)
    assert_compiled_matches_eager(model, traj, STEPS, "sd3", 2, capsys)


def test_sd35_medium_config_loads(folder):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/sd35_medium.yaml", [f"model.pretrained={folder}"])
    assert cfg.model.pretrained == str(folder) and cfg.model.options["image_size"] == 512
    assert (cfg.rollout.num_inference_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale) == (10, 0.7, 4.5)
    assert (cfg.policy.lora_rank, cfg.policy.lora_alpha) == (32, 64)
    assert (cfg.grpo.loss["clip_range"], cfg.grpo.loss["beta"]) == (1e-4, 0.04)
    assert cfg.optim.lr == 3e-4 and cfg.train.precision == "bf16" and cfg.perf.preset == "gpu"
    assert iteration_shape(cfg)[0] == cfg.rollout.prompts_per_step * cfg.rollout.group_size


def test_grpo_iteration_exports_load_in_diffusers(folder, tmp_path, capsys):
    from posttrain.grpo.stage import train as grpo_train
    from rewards.base import REGISTRY, register
    from tests.conftest import grpo_config

    if "test_sd3_brightness" not in REGISTRY:
        register("test_sd3_brightness")(lambda: lambda images, prompts=None, metadata=None: images.mean(dim=(1, 2, 3)))
    cfg = grpo_config(tmp_path, folder, "train.steps=1", "rewards.jpeg_compressibility=0",
                      "rewards.test_sd3_brightness=1.0", "model.options.max_sequence_length=32", "data.limit=4",
                      "rollout.num_inference_steps=3", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "rollout.batch_size=4", "train.batch_size=4", "eval.grid_prompts=2",
                      "eval.num_inference_steps=2", "optim.lr=3e-2")
    export = grpo_train(cfg)
    lora = tmp_path / "grpo/lora"
    assert (export / "model_index.json").is_file() and (lora / "pytorch_lora_weights.safetensors").is_file()
    noise = initial_noise()
    lat, img, meta = our_images(export, noise)
    assert meta["options"] == {"max_sequence_length": 32} and meta["family"] == "sd3"
    kw = dict(max_sequence_length=32)
    exp_lat, exp_img = pipeline_images(diffusers_pipe(export), noise, **kw)
    lora_lat, lora_img = pipeline_images(diffusers_pipe(folder, lora), noise, **kw)
    _, base_img = pipeline_images(diffusers_pipe(folder), noise, **kw)
    d_exp = max((lat - exp_lat).abs().max().item(), (img - exp_img).abs().max().item())
    d_lora = max((lat - lora_lat).abs().max().item(), (img - lora_img).abs().max().item())
    moved = (img - base_img).abs().max().item()
    with capsys.disabled():
        print(f"\nsd3 GRPO export: max diff vs StableDiffusion3Pipeline(export) {d_exp:.2e}, vs base + "
              f"load_lora_weights(lora) {d_lora:.2e}; change from the base model {moved:.2e}")
    assert d_exp <= TOL and d_lora <= TOL
    assert moved > 100 * TOL  # the update really changed the model, so the comparisons can fail


def test_a_bad_option_is_a_config_error_naming_the_folder(folder, tmp_path, capsys):
    from posttrain.cli import main

    code = main(["grpo", str(ROOT / "configs/grpo/emoji_tiny.yaml"), f"run_dir={tmp_path}",
                 f"model.pretrained={folder}", "model.options.foo=1"])
    err = capsys.readouterr().err
    assert code == 2 and str(folder) in err and "model.options: unknown ['foo']" in err, err
