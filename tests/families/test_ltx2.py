"""LTX-2 (``LTX2Pipeline``, an audio-video transformer) on a tiny random folder: our ODE sampler reproduces the
pipeline's video and audio latents and its frames (CFG only: no STG, modality isolation or rescale), the
rollout's log-probs are recomputed in training, and a GRPO run exports a folder and a LoRA that the pipeline
loads."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.family_checks import export_vs_pipeline, max_diff, one_grpo_iteration, worst_ratio_deviation

pytestmark = pytest.mark.core

STEPS, SCALE, AUDIO_SCALE, SIZE, FRAMES, FPS, LENGTH = 3, 3.0, 5.0, 32, 3, 25.0, 16
OPTIONS = {"image_size": SIZE, "num_frames": FRAMES, "frame_rate": FPS, "max_sequence_length": LENGTH,
           "audio_guidance_scale": AUDIO_SCALE}
PROMPTS = ["a robot dancing", "a red car"]
CFG_ONLY = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
                audio_guidance_rescale=0.0)


def build_tiny_ltx2(path):
    """Save a tiny ``LTX2Pipeline`` (seed 0): a 2-layer transformer over 4-channel video latents and 2 x 2 audio
    latents, text connectors without registers, a 2-layer Gemma-3 (byte tokenizer), one-level video and audio
    VAEs with non-trivial latent statistics, and the released folders' dynamically shifted scheduler."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from tests.families.tiny_tokenizers import qwen2_tokenizer

    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                            pad_token_id=256, eos_token_id=256, bos_token_id=256)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    gemma = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                        mm_tokens_per_image=4))
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=16, rope_double_precision=False, rope_type="split")
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False, scaling_factor=1.5)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    for v in (vae, audio_vae):  # normalisation that is not the identity, so a missed one shows
        v.latents_mean.copy_(0.1 * torch.randn(v.latents_mean.shape))
        v.latents_std.copy_(1 + 0.5 * torch.rand(v.latents_std.shape))
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=gemma, tokenizer=qwen2_tokenizer(),
                 connectors=connectors, transformer=transformer, vocoder=vocoder).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ltx2_folder(tmp_path_factory):
    return build_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2") / "pipeline")


def _pipeline(pipe, noise, codec, prompts=PROMPTS, steps=STEPS, output_type="pt", scale=SCALE):
    """The pipeline from our joint noise ``[B, S_v + S_a, C]`` (its packed video latents as given, its audio
    latents de-normalised so that its normalisation gives ours back), CFG only: frames ``[B, F, 3, H, W]``,
    or with ``output_type`` "latent" the final state in our layout (normalised and packed again)."""
    v, a = noise[:, :-codec.audio_tokens], noise[:, -codec.audio_tokens:]
    a = a * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean
    out = pipe(prompts, latents=v.clone(), audio_latents=a.clone(), num_inference_steps=steps, guidance_scale=scale,
               audio_guidance_scale=AUDIO_SCALE, height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=FPS,
               max_sequence_length=LENGTH, output_type=output_type, **CFG_ONLY)
    if output_type != "latent":
        return out.frames
    video = pipe._pack_latents(pipe._normalize_latents(out.frames, pipe.vae.latents_mean, pipe.vae.latents_std,
                                                       pipe.vae.config.scaling_factor))
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(out.audio), pipe.audio_vae.latents_mean,
                                          pipe.audio_vae.latents_std)
    return torch.cat([video, audio], 1)


def test_sampler_encoder_and_schedule_match_the_pipeline(ltx2_folder, capsys):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(ltx2_folder)
    pipe.set_progress_bar_config(disable=True)
    model, encoder, codec, meta = load_exported(ltx2_folder, options=OPTIONS)
    assert meta["family"] == "ltx2" and meta["image_size"] == SIZE
    embeds = encoder.encode(PROMPTS)
    assert embeds.tokens.shape == (2, LENGTH, 32) and embeds.pooled.shape == (2, 0)
    noise = initial_noise(len(PROMPTS), codec.latent_shape(SIZE, SIZE), 0)
    assert noise.shape == (2, 2 * 16 * 16 + 3, 4)  # 2 latent frames of 16 x 16 tokens, then 3 audio frames
    state = sample_latents(model.eval(), embeds, encoder.encode([""]), noise, STEPS, SCALE, None)
    want_state = _pipeline(pipe, noise, codec, output_type="latent")
    want_frames = _pipeline(pipe, noise, codec)
    video = codec.video_tokens(SIZE, SIZE)
    d_video = max_diff(state[:, :video], want_state[:, :video])
    d_audio = max_diff(state[:, video:], want_state[:, video:])
    d_frames = max_diff(codec.decode(state), want_frames)
    with capsys.disabled():
        print(f"\nLTX-2 vs LTX2Pipeline: video latents {d_video:.2e}, audio latents {d_audio:.2e} (|max| "
              f"{state.abs().max():.2f}), frames {d_frames:.2e}; sigmas {model.sigmas(STEPS).tolist()}")
    assert d_video <= 1e-5 and d_audio <= 1e-5 and d_frames <= 1e-5
    # at a video scale of 1 the pipeline still guides the audio (at its own scale), and so do we
    unit = sample_latents(model, embeds, encoder.encode([""]), noise, STEPS, 1.0, None)
    d_unit = max_diff(unit, _pipeline(pipe, noise, codec, output_type="latent", scale=1.0))
    assert d_unit <= 1e-5, d_unit
    # the audio guidance scale is its own: with the video's scale on the audio too, the audio moves
    model.audio_guidance_scale = SCALE
    other = sample_latents(model, embeds, encoder.encode([""]), noise, STEPS, SCALE, None)
    assert max_diff(other[:, :video], state[:, :video]) > 0 and max_diff(other[:, video:], state[:, video:]) > 1e-3


def test_log_probs_are_recomputed_in_training(ltx2_folder, capsys):
    worst = worst_ratio_deviation(ltx2_folder, OPTIONS, [*PROMPTS, "a face"], STEPS, SCALE, SIZE)
    with capsys.disabled():
        print(f"\nLTX-2: largest |ratio - 1| of recomputed log-probs {worst:.2e}")
    assert worst <= 1e-5


def test_grpo_iteration_exports_and_a_lora_that_load_in_diffusers(ltx2_folder, tmp_path, capsys):
    from diffusers import LTX2Pipeline

    from tests.families.test_wan import REGISTRY  # importing it registers the test_video_brightness reward

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a robot dancing\na green flag\na smiling face\na blue car\n")
    (prompts / "test.txt").write_text("a yellow star\n")
    options = [f"model.options.{k}={v}" for k, v in OPTIONS.items()]
    assert "test_video_brightness" in REGISTRY
    export = one_grpo_iteration(tmp_path, ltx2_folder, SCALE, *options, "data.source=prompts", f"data.path={prompts}",
                                "rewards.jpeg_compressibility=0", "rewards.test_video_brightness=1.0")
    _, _, codec, _ = load_exported(ltx2_folder, options=OPTIONS)
    d_export, d_lora, d_base = export_vs_pipeline(
        LTX2Pipeline, ltx2_folder, export, tmp_path / "grpo/lora",
        lambda pipe, noise: _pipeline(pipe, noise, codec, PROMPTS[:1]), size=SIZE, steps=STEPS, scale=SCALE,
        prompt=PROMPTS[0], options=OPTIONS)
    with capsys.disabled():
        print(f"\nLTX-2 GRPO export: LTX2Pipeline(export) vs ours {d_export:.2e}; base + lora/ {d_lora:.2e}; "
              f"base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4


def test_real_ltx2_config_loads(ltx2_folder):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config
    from tests.conftest import ROOT

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/ltx2.yaml", [f"model.pretrained={ltx2_folder}"])
    assert cfg.model.options == {"image_size": 512, "num_frames": 121, "frame_rate": 24.0, "max_sequence_length": 256,
                                 "dtype": "bfloat16"}
    assert iteration_shape(cfg)[0] == 32 and cfg.parallel.activation_checkpointing
