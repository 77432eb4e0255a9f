"""FLUX.2 [klein] family (``pretrain.models.flux2``) against diffusers' ``Flux2KleinPipeline`` on a tiny
randomly initialised folder (1 double + 1 single block, a 28-layer Qwen3 of width 16, a 2-level VAE
whose batch-norm statistics are not the identity)."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.family_checks import export_vs_pipeline, max_diff, one_grpo_iteration, worst_ratio_deviation

pytestmark = pytest.mark.core

SIZE, STEPS, SCALE = 32, 4, 4.0
OPTIONS = {"image_size": SIZE, "max_sequence_length": 64}
PROMPTS = ["a red apple", "the flag of a cat"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_flux2(path):
    """Save a tiny ``Flux2KleinPipeline`` with random weights (seed 0)."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.families.tiny_tokenizers import qwen2_tokenizer

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=False)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=28,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                vocab_size=300, bos_token_id=None, eos_token_id=256))
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                             norm_num_groups=4)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = CHAT
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def flux2_folder(tmp_path_factory):
    return build_tiny_flux2(tmp_path_factory.mktemp("tiny_flux2") / "pipeline")


def pipeline_images(pipe, prompts, noise, steps=STEPS, scale=SCALE):
    """The pipeline's final latents (``[B, 4C, h', w']``, from its packed ones) and ``output_type="pt"``
    images from the initial ``noise`` ``[B, 4C, h', w']``."""
    seen = {}

    def keep(_pipe, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    images = pipe(prompt=prompts, latents=noise.clone(), guidance_scale=scale, num_inference_steps=steps, height=SIZE,
                  width=SIZE, max_sequence_length=64, output_type="pt", callback_on_step_end=keep).images
    b, c, h, w = noise.shape
    return seen["latents"].permute(0, 2, 1).reshape(b, c, h, w), images


def test_sampler_encoder_schedule_and_codec_match_the_pipeline(flux2_folder, capsys):
    from diffusers import Flux2KleinPipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    pipe = Flux2KleinPipeline.from_pretrained(flux2_folder)
    pipe.set_progress_bar_config(disable=True)
    model, encoder, codec, meta = load_exported(flux2_folder, options=OPTIONS)
    assert meta["family"] == "flux2" and meta["sampling"]["guidance_scale"] == 4.0
    assert codec.latent_shape(SIZE, SIZE) == (16, 8, 8)
    pipe.scheduler.set_timesteps(sigmas=[1.0 - i / STEPS for i in range(STEPS)], mu=compute_empirical_mu(64, STEPS))
    assert max_diff(model.sigmas(STEPS), pipe.scheduler.sigmas) <= 1e-7 and model.sigmas(STEPS)[-1] == 0
    with torch.no_grad():
        want, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=64)
    ours = encoder.encode(PROMPTS)
    assert ours.tokens.shape == (2, 64, 48) and torch.equal(ours.tokens, want)

    # encode inverts decode's normalisation: the pipeline's image latents of an image
    images = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    want_z = pipe._encode_vae_image(images * 2 - 1, generator=None)
    assert max_diff(codec.encode(images), want_z) <= 1e-5

    noise = initial_noise(2, codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model, ours, encoder.encode([""]), noise, STEPS, SCALE, None)
    images = codec.decode(latents)
    want_latents, want_images = pipeline_images(pipe, PROMPTS, noise)
    d_lat, d_img = max_diff(latents, want_latents), max_diff(images, want_images)
    with capsys.disabled():
        print(f"\nflux.2 klein vs Flux2KleinPipeline (CFG {SCALE}): latents {d_lat:.2e} "
              f"(|max| {latents.abs().max():.2f}), images {d_img:.2e}")
    assert d_lat <= 1e-5 and d_img <= 1e-5 and images.std() > 0.01


def test_rollout_log_probs_recomputed_and_grpo_export_and_lora_load_in_diffusers(flux2_folder, tmp_path, capsys):
    from diffusers import Flux2KleinPipeline

    from safetensors.torch import load_file


    worst = worst_ratio_deviation(flux2_folder, OPTIONS, [*PROMPTS, "a face", "the flag"], STEPS, SCALE, SIZE)
    assert worst <= 1e-5, worst

    export = one_grpo_iteration(tmp_path, flux2_folder, SCALE, f"model.options.image_size={SIZE}",
                                 "model.options.max_sequence_length=64")
    lora = load_file(str(tmp_path / "grpo/lora/pytorch_lora_weights.safetensors"))
    assert any("single_transformer_blocks" in k and "to_qkv_mlp_proj" in k for k in lora)  # both block kinds
    d_export, d_lora, d_base = export_vs_pipeline(
        Flux2KleinPipeline, flux2_folder, export, tmp_path / "grpo/lora",
        lambda pipe, noise: pipeline_images(pipe, PROMPTS[:1], noise, steps=3)[1], size=SIZE, steps=3, scale=SCALE,
        prompt=PROMPTS[0], options={"max_sequence_length": 64})
    with capsys.disabled():
        print(f"\nflux.2 klein: rollout ratio {worst:.2e}; GRPO export vs Flux2KleinPipeline {d_export:.2e}; "
              f"base + lora/ {d_lora:.2e}; base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4
