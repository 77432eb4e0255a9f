"""FLUX.1 family against diffusers' FluxPipeline on a tiny random pipeline folder (guidance-embedded
like FLUX.1-dev): our ODE sampler reproduces the pipeline, the GRPO ratio starts at 1, and a GRPO run's
export / LoRA load back into FluxPipeline with the same images."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.conftest import ROOT, grpo_config
from tests.families.tiny_tokenizers import clip_tokenizer, t5_tokenizer

pytestmark = pytest.mark.core

SIZE, STEPS, GUIDANCE, MAX_LEN = 32, 4, 3.5, 32
OPTIONS = {"image_size": SIZE, "max_sequence_length": MAX_LEN, "guidance": GUIDANCE}
PROMPTS = ["a red apple", "the flag of a cat"]
TOL = 1e-5  # float32 rounding


def save_tiny_flux(path):
    """A random FluxPipeline (1 double + 1 single block, 16 latent channels, vae_scale_factor 4)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer(MAX_LEN)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                                        projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=SIZE,
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    FluxPipeline(scheduler, vae, clip, clip_tok, t5, t5_tok, transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return save_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")


def _pipeline_images(pipe, noise, num_steps=STEPS):
    """FluxPipeline's latents (unpacked) and images from our unit ``noise`` [B, 16, h, w]."""
    from diffusers import FluxPipeline

    pipe.set_progress_bar_config(disable=True)
    b, c, h, w = noise.shape
    kw = dict(latents=FluxPipeline._pack_latents(noise, b, c, h, w), num_inference_steps=num_steps,
              guidance_scale=GUIDANCE, height=SIZE, width=SIZE, max_sequence_length=MAX_LEN)
    latents = pipe(PROMPTS, output_type="latent", **kw).images
    images = pipe(PROMPTS, output_type="pt", **kw).images
    return FluxPipeline._unpack_latents(latents, SIZE, SIZE, pipe.vae_scale_factor), images


def _our_images(folder, noise, options=None, num_steps=STEPS):
    model, encoder, codec, meta = load_exported(folder, options=options)
    latents = sample_latents(model.eval(), encoder.encode(PROMPTS), encoder.encode([""]), noise, num_steps,
                             guidance_scale=meta["sampling"]["guidance_scale"], shift=None)
    return latents, codec.decode(latents)


def _noise():
    """Unit noise of one latent per prompt, ``[2, 16, SIZE / 4, SIZE / 4]`` (vae_scale_factor 4)."""
    return initial_noise(len(PROMPTS), (16, SIZE // 4, SIZE // 4), seed=0)


def test_meta_schedule_and_options(flux_dir):
    from diffusers import FluxPipeline

    model, encoder, codec, meta = load_exported(flux_dir, options=OPTIONS)
    assert meta["family"] == "flux" and meta["pipeline"] == "FluxPipeline" and meta["component"] == "transformer"
    assert meta["image_size"] == SIZE and meta["sampling"] == {"num_inference_steps": 28, "guidance_scale": 1.0,
                                                               "shift": None}
    assert codec.latent_shape(SIZE, SIZE) == (16, 8, 8) and (encoder.dim, encoder.pooled_dim) == (32, 32)
    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe(PROMPTS[0], num_inference_steps=STEPS, height=SIZE, width=SIZE, max_sequence_length=MAX_LEN,
         output_type="latent")
    assert torch.equal(model.sigmas(STEPS), pipe.scheduler.sigmas)  # dynamic shift, mu from 16 image tokens
    base = torch.linspace(1, 1 / STEPS, STEPS, dtype=torch.float64)
    torch.testing.assert_close(model.sigmas(STEPS, 3.0)[:-1], (3 * base / (1 + 2 * base)).float())
    # encoder = the pipeline's encode_prompt, padded to max_sequence_length
    with torch.no_grad():
        tokens, pooled, _ = pipe.encode_prompt(PROMPTS, None, max_sequence_length=MAX_LEN)
    e = encoder.encode(PROMPTS)
    assert torch.equal(e.tokens, tokens) and torch.equal(e.pooled, pooled) and e.tokens.shape == (2, MAX_LEN, 32)
    # the embedded guidance reaches the transformer
    x, sigma = torch.randn(2, 16, 8, 8), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        low = load_exported(flux_dir, options={**OPTIONS, "guidance": 1.0})[0](x, sigma, e)
        assert (model(x, sigma, e) - low).abs().max() > 1e-4
    assert encoder.cache_key != load_exported(flux_dir, options={**OPTIONS, "max_sequence_length": 16})[1].cache_key
    with pytest.raises(ValueError, match="model.options.image_size"):
        load_exported(flux_dir, options={"image_size": 36})
    with pytest.raises(ValueError, match="model.options.guidance_scale"):
        load_exported(flux_dir, options={**OPTIONS, "guidance_scale": 3.5})
    with pytest.raises(ValueError, match="model.options.dtype"):
        load_exported(flux_dir, options={**OPTIONS, "dtype": "fp8"})
    half = load_exported(flux_dir, options={**OPTIONS, "dtype": "bfloat16"})[0]
    with torch.no_grad():
        v = half(x, sigma, e)
    assert half.transformer.dtype == torch.bfloat16 and v.dtype == torch.float32 and v.shape == x.shape


def test_ode_sampler_reproduces_flux_pipeline(flux_dir, capsys):
    from diffusers import FluxPipeline

    noise = _noise()
    ours, our_images = _our_images(flux_dir, noise, OPTIONS)
    theirs, images = _pipeline_images(FluxPipeline.from_pretrained(flux_dir), noise)
    d_lat, d_img = (ours - theirs).abs().max().item(), (our_images - images).abs().max().item()
    with capsys.disabled():
        print(f"\nFLUX ours vs FluxPipeline: latents max |diff| {d_lat:.2e}, images {d_img:.2e}")
    assert our_images.shape == images.shape == (2, 3, SIZE, SIZE)
    assert (ours - noise).abs().max() > 0.1  # the sampler really moved
    assert d_lat <= TOL and d_img <= TOL


def _lora_rollout(folder):
    """The tiny model with a perturbed LoRA policy (train mode) and a rollout of 6 samples (3 prompts x
    group 2, in batches of 4 + 2)."""
    from pretrain.data.dataset import EncodedSet
    from tests.conftest import sampler_rollout
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, meta = load_exported(folder, options=OPTIONS)
    captions = PROMPTS + ["a cat", "a red flag"]
    prompts = EncodedSet(torch.zeros(4, 3, SIZE, SIZE, dtype=torch.uint8), captions, encoder.encode(captions))
    null = encoder.encode([""])
    perturbed_lora_policy(model)  # LoRA with B != 0: the policy differs from the reference
    assert any("single_transformer_blocks.0.attn.to_q.lora_A" in n for n, _ in model.named_parameters())
    model.eval()
    traj = sampler_rollout(model, codec, prompts, [0, 1, 2], group=2, batch=4, null=null, sigmas=model.sigmas(STEPS),
                           noise=0.7, scale=1.0, latent_shape=codec.latent_shape(SIZE, SIZE))
    return model.train(), traj


def test_grpo_log_probs_recomputed_in_training_equal_rollout(flux_dir, capsys):
    from rollout.sampler import log_prob

    model, traj = _lora_rollout(flux_dir)
    worst = 0.0
    with torch.enable_grad():
        for start in (0, 3):  # mini-batches of 3, rollout batches of 4 + 2
            mb = traj.select(torch.arange(start, start + 3))
            for t in range(STEPS):
                new = log_prob(model, mb, t).log_prob
                assert torch.isfinite(new).all()
                worst = max(worst, (torch.exp(new - mb.log_probs[:, t]) - 1).abs().max().item())
    with capsys.disabled():
        print(f"\nFLUX GRPO: largest |ratio - 1| of training log-probs vs rollout {worst:.2e}")
    assert worst <= 1e-5, worst


@pytest.mark.long
def test_gpu_preset_compiled_blocks_give_eager_log_probs_and_gradients(flux_dir, capsys):
    from tests.families.compiled import assert_compiled_matches_eager

    model, traj = _lora_rollout(flux_dir)  # 2 blocks: the double- and the single-stream one
    assert_compiled_matches_eager(model, traj.select(torch.arange(3)), STEPS, "FLUX", 2, capsys)


def test_grpo_run_exports_a_flux_pipeline_and_lora(flux_dir, tmp_path, capsys):
    from diffusers import FluxPipeline

    from posttrain.grpo.stage import train as grpo_train
    from rewards.base import REGISTRY, register

    if "test_brightness" not in REGISTRY:
        register("test_brightness")(lambda: lambda images, prompts=None, metadata=None: images.mean(dim=(1, 2, 3)))
    export = grpo_train(grpo_config(
        tmp_path, flux_dir, "rollout.guidance_scale=1.0", "eval.guidance_scale=1.0", f"model.options.image_size={SIZE}",
        f"model.options.max_sequence_length={MAX_LEN}", "rewards.jpeg_compressibility=0", "rewards.test_brightness=1.0",
        "data.limit=4", "rollout.num_inference_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.batch_size=4", "train.batch_size=4", "train.steps=1", "optim.lr=0.05", "eval.grid_prompts=2",
        "eval.num_inference_steps=2"))
    noise = _noise()
    ours, our_images = _our_images(export, noise)  # options (size, T5 length) recorded in the export
    base_images = _our_images(flux_dir, noise, OPTIONS)[1]
    _, export_images = _pipeline_images(FluxPipeline.from_pretrained(export), noise)
    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.load_lora_weights(str(tmp_path / "grpo/lora"))
    _, lora_images = _pipeline_images(pipe, noise)
    d_export, d_lora = (export_images - our_images).abs().max().item(), (lora_images - our_images).abs().max().item()
    moved = (our_images - base_images).abs().max().item()
    with capsys.disabled():
        print(f"\nFLUX GRPO export: FluxPipeline(export) vs ours max |diff| {d_export:.2e}; base + LoRA file "
              f"{d_lora:.2e}; change from the base model {moved:.2e}")
    assert moved > 1e-3  # the update changed the model, so the comparisons below can fail
    assert d_export <= TOL and d_lora <= TOL


def test_flux1_dev_config_loads(flux_dir):
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import load_config

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/flux1_dev.yaml", [f"model.pretrained={flux_dir}"])
    assert cfg.rollout.guidance_scale == 1.0 and cfg.eval.guidance_scale == 1.0
    assert cfg.model.options["guidance"] == 3.5 and cfg.model.options["image_size"] == 512
    assert (cfg.policy.lora_rank, cfg.rollout.num_inference_steps, cfg.data.source) == (32, 6, "prompts")
    assert cfg.model.pretrained == str(flux_dir) and cfg.perf.preset == "gpu"
