"""HiDream-I1 (``HiDreamImagePipeline``, a mixture-of-experts DiT) on a tiny random folder: our ODE sampler
reproduces the pipeline, the rollout's log-probs are recomputed in training (the MoE's training path),
gradients reach the routed experts in both modes, and a GRPO run exports a folder and a LoRA that the
pipeline loads."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.family_checks import export_vs_pipeline, max_diff, one_grpo_iteration, worst_ratio_deviation

pytestmark = pytest.mark.core

STEPS, SCALE, LENGTH = 3, 5.0, 16
OPTIONS = {"max_sequence_length": LENGTH}
PROMPTS = ["a red apple", "a cat flag"]


def build_tiny_hidream(path):
    """Save a tiny ``HiDreamImagePipeline`` (seed 0): 1 double- and 1 single-stream block, 4 routed experts
    (2 active) with a shared one, patch 8 on a 4-channel VAE that does not downsample (the pipeline renders
    128 x 128 pixels: its 128 x vae_scale_factor), two CLIP, a T5 and a 2-layer Llama."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel

    from tests.families.test_sd3 import tiny_clip
    from tests.families.tiny_tokenizers import clip_tokenizer, qwen2_tokenizer, t5_tokenizer

    torch.manual_seed(0)
    clip_tok = clip_tokenizer()
    clip = lambda: tiny_clip(clip_tok)  # noqa: E731
    t5 = T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=2,
                                 relative_attention_num_buckets=8, decoder_start_token_id=0))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         bos_token_id=None, eos_token_id=256, pad_token_id=256))
    transformer = HiDreamImageTransformer2DModel(
        patch_size=8, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_channels=[32, 24], text_emb_dim=32, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(128, 128), llama_layers=[0, 1])
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=128, scaling_factor=1.5, shift_factor=0.1)
    HiDreamImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=clip(),
                         tokenizer=clip_tok, text_encoder_2=clip(), tokenizer_2=clip_tokenizer(), text_encoder_3=t5,
                         tokenizer_3=t5_tokenizer(), text_encoder_4=llama, tokenizer_4=qwen2_tokenizer(),
                         transformer=transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hidream_folder(tmp_path_factory):
    return build_tiny_hidream(tmp_path_factory.mktemp("tiny_hidream") / "pipeline")


def _pipeline(pipe, noise, prompts=PROMPTS, steps=STEPS):
    """The pipeline's final latents (its step-end callback) and images from ``noise``, CFG with ""."""
    seen = {}

    def keep(_pipe, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    pipe.set_progress_bar_config(disable=True)
    images = pipe(prompts, latents=noise.clone(), num_inference_steps=steps, guidance_scale=SCALE,
                  max_sequence_length=LENGTH, output_type="pt", callback_on_step_end=keep).images
    return seen["latents"], images


def test_sampler_encoder_and_schedule_match_the_pipeline(hidream_folder, capsys):
    from diffusers import HiDreamImagePipeline

    pipe = HiDreamImagePipeline.from_pretrained(hidream_folder)
    model, encoder, codec, meta = load_exported(hidream_folder, options=OPTIONS)
    assert meta["family"] == "hidream" and meta["image_size"] == 128
    embeds = encoder.encode(PROMPTS)
    assert embeds.tokens.shape == (2, LENGTH + 2 * LENGTH, 32) and embeds.pooled.shape == (2, 32)
    size = meta["image_size"]
    noise = initial_noise(len(PROMPTS), codec.latent_shape(size, size), 0)
    latents = sample_latents(model.eval(), embeds, encoder.encode([""]), noise, STEPS, SCALE, None)
    want_latents, want_images = _pipeline(pipe, noise)
    d_lat, d_img = max_diff(latents, want_latents), max_diff(codec.decode(latents), want_images)
    with capsys.disabled():
        print(f"\nHiDream vs HiDreamImagePipeline: latents {d_lat:.2e} (|max| {latents.abs().max():.2f}), "
              f"images {d_img:.2e}")
    assert d_lat <= 1e-5 and d_img <= 1e-5


def test_log_probs_recomputed_in_training_and_the_routed_experts_get_gradients(hidream_folder, capsys):
    worst = worst_ratio_deviation(hidream_folder, OPTIONS, [*PROMPTS, "a face"], STEPS, SCALE, 128)
    model, encoder, codec, _ = load_exported(hidream_folder, options=OPTIONS)
    x, sigma, embeds = torch.randn(2, *codec.latent_shape(128, 128)), torch.tensor([0.9, 0.4]), encoder.encode(PROMPTS)
    grads = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        model.zero_grad()
        v = model(x, sigma, embeds)
        v.square().mean().backward()
        routed = [p.grad for n, p in model.named_parameters() if ".ff_i.experts." in n]
        grads[mode] = (v.detach(), sum(float(g.abs().sum()) for g in routed if g is not None), len(routed))
    with capsys.disabled():
        print(f"\nHiDream: largest |ratio - 1| {worst:.2e}; routed-expert |grad| sum eval {grads['eval'][1]:.3e}, "
              f"train {grads['train'][1]:.3e}; velocity eval vs train {max_diff(grads['eval'][0], grads['train'][0]):.2e}")
    assert worst <= 1e-5
    assert grads["eval"][2] > 0 and grads["eval"][1] > 0  # diffusers' eval path runs them under no_grad
    assert abs(grads["eval"][1] - grads["train"][1]) <= 1e-5 * grads["train"][1]
    assert max_diff(grads["eval"][0], grads["train"][0]) <= 1e-5  # train()'s patch layout folded back
    # at 64 x 64 latents with patch 8 the patch layout [B, C, 64, 64] has the image's shape: folded all the same
    x64 = torch.randn(2, 4, 64, 64)
    with torch.no_grad():
        train64 = model.train()(x64, sigma, embeds)
        assert max_diff(model.eval()(x64, sigma, embeds), train64) <= 1e-5


def test_grpo_iteration_exports_and_a_lora_that_load_in_diffusers(hidream_folder, tmp_path, capsys):
    from diffusers import HiDreamImagePipeline

    prompts = tmp_path / "prompts"  # a prompt file: no 128-px renders to make
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red apple\na green flag\na smiling face\na blue car\n")
    (prompts / "test.txt").write_text("a yellow star\n")
    export = one_grpo_iteration(tmp_path, hidream_folder, SCALE, f"model.options.max_sequence_length={LENGTH}",
                                "data.source=prompts", f"data.path={prompts}")
    d_export, d_lora, d_base = export_vs_pipeline(
        HiDreamImagePipeline, hidream_folder, export, tmp_path / "grpo/lora",
        lambda pipe, noise: _pipeline(pipe, noise, PROMPTS[:1], 3)[1], size=128, steps=3, scale=SCALE,
        prompt=PROMPTS[0], options=OPTIONS)
    with capsys.disabled():
        print(f"\nHiDream GRPO export: HiDreamImagePipeline(export) vs ours {d_export:.2e}; base + lora/ {d_lora:.2e}; "
              f"base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4


def test_real_hidream_config_loads(hidream_folder):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config
    from tests.conftest import ROOT

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/hidream_i1.yaml", [f"model.pretrained={hidream_folder}"])
    assert cfg.parallel.ep == 4 and cfg.parallel.dims().resolved(8).dp_shard == 8  # EP 4 inside FSDP 8
    assert cfg.model.options == {"max_sequence_length": 128, "num_inference_steps": 50, "dtype": "bfloat16"}
    assert iteration_shape(cfg)[0] == 128 and cfg.policy.target_modules is None  # the family's attention
