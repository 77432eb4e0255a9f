"""Qwen-Image family (``pretrain.models.qwenimage``) against diffusers' ``QwenImagePipeline`` on a tiny
randomly initialised folder (2-block transformer, 2-layer Qwen2.5-VL, 4-channel causal VAE)."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.family_checks import export_vs_pipeline, max_diff, one_grpo_iteration, worst_ratio_deviation

pytestmark = pytest.mark.core

SIZE, STEPS, SCALE = 32, 4, 4.0
OPTIONS = {"image_size": SIZE, "max_sequence_length": 192}
PROMPTS = ["a red apple", "the flag of a cat"]  # different lengths: the batch's states are masked


def build_tiny_qwenimage(path):
    """Save a tiny ``QwenImagePipeline`` with random weights (seed 0) and Qwen-Image's scheduler settings
    (dynamic exponential shift, terminal sigma 0.02)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tests.families.tiny_tokenizers import qwen2_tokenizer

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=300, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=None,
                eos_token_id=256)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1, window_size=8, fullatt_block_indexes=[0])
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=300, hidden_size=32, bos_token_id=None, eos_token_id=256))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 1.5, 2.0, 1.0])
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=qwen2_tokenizer(),
                      transformer=transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return build_tiny_qwenimage(tmp_path_factory.mktemp("tiny_qwenimage") / "pipeline")


def pack(x):
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, 4 * c)


def pipeline_images(pipe, prompts, noise, steps=STEPS, scale=SCALE, size=SIZE):
    """The pipeline's final (packed) latents and ``output_type="pt"`` images from the initial ``noise``
    ``[B, C, h, w]``, true CFG at ``scale`` with the empty negative prompt."""
    seen = {}

    def keep(_pipe, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    images = pipe(prompts, negative_prompt=[""] * len(prompts), true_cfg_scale=scale, latents=pack(noise),
                  num_inference_steps=steps, height=size, width=size, max_sequence_length=192, output_type="pt",
                  callback_on_step_end=keep).images
    return seen["latents"], images


def test_sampler_encoder_schedule_and_guidance_match_the_pipeline(qwen_folder, capsys):
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    pipe = QwenImagePipeline.from_pretrained(qwen_folder)
    pipe.set_progress_bar_config(disable=True)
    model, encoder, codec, meta = load_exported(qwen_folder, options=OPTIONS)
    assert meta["family"] == "qwenimage" and meta["sampling"]["guidance_scale"] == 4.0
    cfg = pipe.scheduler.config
    mu = calculate_shift(4, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    pipe.scheduler.set_timesteps(sigmas=[1.0 - i / STEPS for i in range(STEPS)], mu=mu)
    assert max_diff(model.sigmas(STEPS), pipe.scheduler.sigmas) <= 1e-7 and model.sigmas(STEPS)[-1] == 0
    with torch.no_grad():
        want, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=192)
    ours = encoder.encode(PROMPTS)
    assert ours.tokens.shape == (2, 192, 32) and ours.pooled.shape == (2, 0) and mask is not None
    assert torch.equal(ours.tokens[:, :want.shape[1]], want) and not ours.tokens[:, want.shape[1]:].any()

    # the norm-rescaled guidance on packed tokens, as the pipeline writes it
    g = torch.Generator().manual_seed(0)
    v_cond, v_uncond = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    comb = pack(v_uncond) + SCALE * (pack(v_cond) - pack(v_uncond))
    packed = comb * (torch.norm(pack(v_cond), dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert max_diff(pack(model.cfg_combine(v_cond, v_uncond, SCALE)), packed) <= 1e-6

    noise = initial_noise(2, codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model, ours, encoder.encode([""]), noise, STEPS, SCALE, None)
    images = codec.decode(latents)
    want_latents, want_images = pipeline_images(pipe, PROMPTS, noise)
    d_lat, d_img = max_diff(pack(latents), want_latents), max_diff(images, want_images)
    with capsys.disabled():
        print(f"\nqwen-image vs QwenImagePipeline (true CFG {SCALE}): latents {d_lat:.2e} "
              f"(|max| {latents.abs().max():.2f}), images {d_img:.2e}")
    assert d_lat <= 1e-5 and d_img <= 1e-5 and images.shape == (2, 3, SIZE, SIZE) and images.std() > 0.01


def test_rollout_log_probs_recomputed_in_training_equal_rollout(qwen_folder):
    # mini-batches of 3 (not the rollout's 4): other prompt lengths, so other masks, per batch
    worst = worst_ratio_deviation(qwen_folder, OPTIONS, [*PROMPTS, "a face", "the flag"], STEPS, SCALE, SIZE)
    assert worst <= 1e-5, worst


def test_grpo_iteration_exports_and_a_lora_that_load_in_diffusers(qwen_folder, tmp_path, capsys):
    from diffusers import QwenImagePipeline


    export = one_grpo_iteration(tmp_path, qwen_folder, SCALE, f"model.options.image_size={SIZE}",
                                 "model.options.max_sequence_length=192")
    assert load_exported(export)[3]["image_size"] == SIZE
    d_export, d_lora, d_base = export_vs_pipeline(
        QwenImagePipeline, qwen_folder, export, tmp_path / "grpo/lora",
        lambda pipe, noise: pipeline_images(pipe, PROMPTS[:1], noise, steps=3)[1], size=SIZE, steps=3, scale=SCALE,
        prompt=PROMPTS[0], options={"max_sequence_length": 192})
    with capsys.disabled():
        print(f"\nqwen-image GRPO export: QwenImagePipeline(export) vs ours {d_export:.2e}; "
              f"base + lora/ {d_lora:.2e}; base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4


def test_dpo_and_forward_process_nft_steps_run_on_the_family(qwen_folder, tmp_path):
    """Diffusion-DPO's first step (LoRA B = 0: the policy is the reference, loss exactly log 2) and one
    DiffusionNFT iteration (the forward process, no log-probs) on a Qwen-Image folder; both adapters
    move."""
    import math

    from safetensors.torch import load_file

    from posttrain.dpo.stage import train as train_dpo
    from posttrain.grpo.stage import GRPOConfig, train as train_grpo
    from pretrain.config import load_config
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import ROOT, dpo_config

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/train.txt").write_text("a red apple\na cat face\na flag\nthe moon\n")
    (tmp_path / "prompts/test.txt").write_text("a red face\n")
    opts = (f"model.options.image_size={SIZE}", "model.options.max_sequence_length=192")
    train_dpo(dpo_config(
        tmp_path / "dpo_run", qwen_folder, *opts, "data.source=prompts", f"data.path={tmp_path / 'prompts'}",
        "train.steps=1", "online.resample_every=1", "checkpoint.every=0", "online.prompts_per_round=2",
        "online.samples_per_prompt=2", "online.num_inference_steps=2", "train.batch_size=2", "eval.grid_prompts=1",
        "eval.num_inference_steps=2", "dpo.error_space=noise", "dpo.beta=5000", "optim.lr=0.05"))
    rec = read_metrics(tmp_path / "dpo_run/dpo/metrics.jsonl")[-1]
    assert rec["reward_margin"] == 0.0 and abs(rec["loss"] - math.log(2)) < 1e-6 and rec["grad_norm"] > 0
    nft = load_config(GRPOConfig, ROOT / "configs/grpo/emoji_nft.yaml", [
        f"run_dir={tmp_path / 'nft_run'}", f"model.pretrained={qwen_folder}", *opts, "data.limit=4", "train.steps=1",
        "rollout.num_inference_steps=4", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
        "train.batch_size=4", "eval.grid_prompts=1", "eval.num_inference_steps=2", "optim.lr=3e-2"])
    train_grpo(nft)
    for lora in (tmp_path / "dpo_run/dpo/lora", tmp_path / "nft_run/grpo/lora"):
        weights = load_file(str(lora / "pytorch_lora_weights.safetensors"))
        assert max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0, lora


def test_real_qwen_image_config_loads(qwen_folder):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config
    from tests.conftest import ROOT

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/qwen_image.yaml", [f"model.pretrained={qwen_folder}"])
    assert cfg.model.options == {"image_size": 512, "max_sequence_length": 256, "num_inference_steps": 50,
                                 "dtype": "bfloat16"}
    assert (cfg.rollout.num_inference_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale) == (10, 0.7, 4.0)
    assert cfg.parallel.activation_checkpointing and cfg.policy.target_modules is None  # the family's targets
    assert iteration_shape(cfg)[0] == cfg.rollout.prompts_per_step * cfg.rollout.group_size == 256
