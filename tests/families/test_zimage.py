"""Z-Image family (``pretrain.models.zimage``) against diffusers' ``ZImagePipeline`` on a tiny randomly
initialised folder (2 joint layers + 1 refiner each, a 2-layer Qwen3 of width 16, a 2-level VAE with
scaling and shift factors)."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.family_checks import export_vs_pipeline, max_diff, one_grpo_iteration, worst_ratio_deviation
from tests.families.test_flux2 import CHAT

pytestmark = pytest.mark.core

SIZE, STEPS, W = 32, 4, 3.0  # W: the pipeline's guidance_scale; ours is W + 1
OPTIONS = {"image_size": SIZE, "max_sequence_length": 64}
PROMPTS = ("a red apple", "the flag of a cat")  # different lengths


def build_tiny_zimage(path):
    """Save a tiny ``ZImagePipeline`` with random weights (seed 0), shift 3 as Z-Image-Turbo ships."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from tests.families.tiny_tokenizers import qwen2_tokenizer

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                                           axes_dims=[4, 6, 6], axes_lens=[256, 32, 32])
    text_encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=300,
                                          bos_token_id=None, eos_token_id=256))
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                        norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159)
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = CHAT
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zimage_folder(tmp_path_factory):
    return build_tiny_zimage(tmp_path_factory.mktemp("tiny_zimage") / "pipeline")


def pipeline_images(pipe, prompts, noise, steps=STEPS, w=W):
    """The pipeline's final latents and ``output_type="pt"`` images from the initial ``noise``, CFG ``w``
    (its convention) with the empty negative prompt."""
    seen = {}

    def keep(_pipe, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    images = pipe(prompt=list(prompts), latents=noise.clone(), guidance_scale=w, num_inference_steps=steps, height=SIZE,
                  width=SIZE, max_sequence_length=64, output_type="pt", callback_on_step_end=keep).images
    return seen["latents"], images


def test_sampler_encoder_schedule_and_guidance_match_the_pipeline(zimage_folder, capsys):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(zimage_folder)
    pipe.set_progress_bar_config(disable=True)
    model, encoder, codec, meta = load_exported(zimage_folder, options=OPTIONS)
    assert meta["family"] == "zimage" and meta["sampling"]["guidance_scale"] == 6.0  # the pipeline's 5 + 1
    pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / STEPS, STEPS).tolist(), mu=0.5)
    assert max_diff(model.sigmas(STEPS), pipe.scheduler.sigmas) == 0.0
    with torch.no_grad():
        want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                     max_sequence_length=64)  # it templates the list it is given in place
    ours = encoder.encode(PROMPTS)
    assert ours.tokens.shape == (2, 64, 16) and len({len(w) for w in want}) == 2
    for row, w in zip(ours.tokens, want):
        assert torch.equal(row[:len(w)], w) and not row[len(w):].any()

    noise = initial_noise(2, codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model, ours, encoder.encode([""]), noise, STEPS, W + 1, None)
    images = codec.decode(latents)
    want_latents, want_images = pipeline_images(pipe, PROMPTS, noise)
    d_lat, d_img = max_diff(latents, want_latents), max_diff(images, want_images)
    with capsys.disabled():
        print(f"\nz-image vs ZImagePipeline (its CFG {W}, ours {W + 1}): latents {d_lat:.2e} "
              f"(|max| {latents.abs().max():.2f}), images {d_img:.2e}")
    assert d_lat <= 1e-5 and d_img <= 1e-5 and images.std() > 0.01


def test_rollout_log_probs_recomputed_and_grpo_export_and_lora_load_in_diffusers(zimage_folder, tmp_path, capsys):
    from diffusers import ZImagePipeline


    worst = worst_ratio_deviation(zimage_folder, OPTIONS, [*PROMPTS, "a face", "the flag"], STEPS, W + 1, SIZE)
    assert worst <= 1e-5, worst

    export = one_grpo_iteration(tmp_path, zimage_folder, W + 1, f"model.options.image_size={SIZE}",
                                 "model.options.max_sequence_length=64")
    d_export, d_lora, d_base = export_vs_pipeline(
        ZImagePipeline, zimage_folder, export, tmp_path / "grpo/lora",
        lambda pipe, noise: pipeline_images(pipe, PROMPTS[:1], noise, steps=3)[1], size=SIZE, steps=3, scale=W + 1,
        prompt=PROMPTS[0], options={"max_sequence_length": 64})
    with capsys.disabled():
        print(f"\nz-image: rollout ratio {worst:.2e}; GRPO export vs ZImagePipeline {d_export:.2e}; "
              f"base + lora/ {d_lora:.2e}; base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4
