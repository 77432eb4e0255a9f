"""Wan2.2 TI2V (``expand_timesteps``: per-token timesteps; a VAE that packs 2 x 2 pixels and downsamples
by 16) text-to-video against diffusers' ``WanPipeline`` on a tiny randomly initialised folder."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.families.test_wan import PROMPTS, build_tiny_wan, max_diff, pipeline_videos

pytestmark = pytest.mark.core

FRAMES, SIZE, STEPS, SCALE = 5, 32, 3, 4.5


def build_tiny_ti2v(path):
    """Save a tiny Wan2.2-TI2V-layout ``WanPipeline`` (random weights, seed 0): ``expand_timesteps``, the
    residual VAE with ``patch_size`` 2 (12 packed channels) and a spatial factor of 16."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=12, decoder_base_dim=16, z_dim=6, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                           scale_factor_spatial=16, scale_factor_temporal=4,
                           latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1],
                           latents_std=[0.5, 1.5, 2.0, 1.0, 0.8, 1.2])
    return build_tiny_wan(path, vae=vae, shift=5.0, expand_timesteps=True)


@pytest.fixture(scope="module")
def ti2v_folder(tmp_path_factory):
    return build_tiny_ti2v(tmp_path_factory.mktemp("tiny_ti2v") / "pipeline")


def test_ti2v_sampler_matches_the_pipeline_and_feeds_per_token_timesteps(ti2v_folder, capsys):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(ti2v_folder)
    assert pipe.config.expand_timesteps
    opts = {"num_frames": FRAMES, "image_size": SIZE, "max_sequence_length": 16}
    model, encoder, codec, meta = load_exported(ti2v_folder, options=opts)
    assert model.expand_timesteps and codec.latent_shape(SIZE, SIZE) == (6, 2, 2, 2)
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    noise = initial_noise(2, codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model, encoder.encode(PROMPTS), encoder.encode([""]), noise, STEPS, SCALE, None)
    hook.remove()
    ours = codec.decode(latents)
    # one timestep per latent token: 2 latent frames x (2 / 2) x (2 / 2) patches, each the step's timestep
    assert seen[0].shape[1:] == (2,) and torch.equal(seen[0], seen[0][:, :1].expand(-1, 2))
    want_latents, want_videos = pipeline_videos(pipe, PROMPTS, noise, steps=STEPS, max_sequence_length=16)
    d_lat, d_vid = max_diff(latents, want_latents), max_diff(ours, want_videos)
    with capsys.disabled():
        print(f"\nwan2.2 ti2v vs WanPipeline: latents {d_lat:.2e}, videos {d_vid:.2e}")
    assert d_lat <= 1e-5 and d_vid <= 1e-5 and ours.shape == (2, FRAMES, 3, SIZE, SIZE) and ours.std() > 0.01
    with pytest.raises(ValueError, match="expand_timesteps"):
        model.sequence_parallel(None)


def test_ti2v_rollout_log_probs_and_grpo_export_load_in_diffusers(ti2v_folder, tmp_path, capsys):
    from diffusers import WanPipeline

    from tests.families.family_checks import one_grpo_iteration, worst_ratio_deviation

    worst = worst_ratio_deviation(ti2v_folder, {"num_frames": FRAMES, "image_size": SIZE, "max_sequence_length": 16},
                                  [*PROMPTS, "a face", "the flag"], STEPS, SCALE, SIZE)
    assert worst <= 1e-5, worst

    export = one_grpo_iteration(tmp_path, ti2v_folder, 4.5, f"model.options.num_frames={FRAMES}",
                                 f"model.options.image_size={SIZE}", "model.options.max_sequence_length=16",
                                 "rewards.jpeg_compressibility=0", "rewards.test_video_brightness=1.0")
    model, encoder, codec, meta = load_exported(export, options={"max_sequence_length": 16})
    assert model.expand_timesteps and meta["image_size"] == SIZE
    noise = initial_noise(1, codec.latent_shape(SIZE, SIZE), 0)
    ours = codec.decode(sample_latents(model, encoder.encode(PROMPTS[:1]), encoder.encode([""]), noise, 3, SCALE, None))
    kw = dict(steps=3, max_sequence_length=16)
    d_export = max_diff(pipeline_videos(WanPipeline.from_pretrained(export), PROMPTS[:1], noise, **kw)[1], ours)
    with_lora = WanPipeline.from_pretrained(ti2v_folder)
    with_lora.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_lora = max_diff(pipeline_videos(with_lora, PROMPTS[:1], noise, **kw)[1], ours)
    d_base = max_diff(pipeline_videos(WanPipeline.from_pretrained(ti2v_folder), PROMPTS[:1], noise, **kw)[1], ours)
    with capsys.disabled():
        print(f"\nwan2.2 ti2v: rollout ratio {worst:.2e}; GRPO export vs WanPipeline {d_export:.2e}; base + lora/ "
              f"{d_lora:.2e}; base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5 and d_base > 1e-4
