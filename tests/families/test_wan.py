"""Wan2.1 family (``pretrain.models.wan``) against diffusers' ``WanPipeline`` on a tiny randomly
initialised pipeline folder (2-layer transformer, 2-layer UMT5, 4-channel causal 3D VAE, 5-frame videos)."""

import itertools
import json

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from rewards.base import REGISTRY, register
from tests.conftest import ROOT, grpo_config

pytestmark = pytest.mark.core

FRAMES, SIZE, STEPS, SCALE, NOISE = 5, 32, 4, 4.5, 0.7
OPTIONS = {"num_frames": FRAMES, "image_size": SIZE}
PROMPTS = ["a red apple moving", "the cat of the flag"]


def build_tiny_wan(path, vae=None, shift: float = 3.0, **pipeline_kw):
    """Save a tiny ``WanPipeline`` with random weights (seed 0) and a flow-match Euler scheduler at
    ``shift``: the 4-channel causal 3D VAE, or ``vae`` (the transformer takes its ``z_dim`` channels);
    ``pipeline_kw`` go to ``WanPipeline`` (e.g. ``expand_timesteps``)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.families.tiny_tokenizers import t5_tokenizer

    torch.manual_seed(0)  # built in this order, so the default folder keeps its weights
    z = 4 if vae is None else vae.config.z_dim
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=z, out_channels=z, text_dim=32, freq_dim=16, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, relative_attention_num_buckets=8))
    vae = vae or AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 1.5, 2.0, 1.0])
    WanPipeline(tokenizer=t5_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), **pipeline_kw).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan") / "pipeline")


def pipeline_videos(pipe, prompts, noise, size=SIZE, steps=STEPS, **kw):
    """The pipeline's final latents (from its step-end callback: what ``output_type="latent"`` returns)
    and its ``output_type="pt"`` videos ``[B, F, 3, H, W]``, from the initial ``noise``."""
    seen = {}

    def keep(_pipe, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    pipe.set_progress_bar_config(disable=True)
    videos = pipe(prompts, latents=noise.clone(), num_inference_steps=steps, guidance_scale=SCALE, height=size,
                  width=size, num_frames=FRAMES, output_type="pt", callback_on_step_end=keep, **kw).frames
    return seen["latents"], videos


def our_videos(folder, prompts, seed=0):
    """Our deterministic Euler ODE on ``load_exported(folder)``: (initial noise, latents, videos)."""
    model, encoder, codec, meta = load_exported(folder, options=OPTIONS)
    size = meta["image_size"]
    noise = initial_noise(len(prompts), codec.latent_shape(size, size), seed)
    latents = sample_latents(model, encoder.encode(prompts), encoder.encode([""]), noise, STEPS, SCALE, None)
    return noise, latents, codec.decode(latents)


def max_diff(a, b) -> float:
    return (torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max().item()


def test_sampler_encoder_and_schedule_match_the_pipeline(wan_folder, capsys):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_folder)
    model, encoder, codec, meta = load_exported(wan_folder, options=OPTIONS)
    assert meta["family"] == "wan" and meta["image_size"] == SIZE and meta["component"] == "transformer"
    assert meta["sampling"] == {"num_inference_steps": 50, "guidance_scale": 5.0, "shift": None}
    pipe.scheduler.set_timesteps(STEPS)
    assert torch.equal(model.sigmas(STEPS), pipe.scheduler.sigmas)
    with torch.no_grad():  # as in WanPipeline.__call__ (SDPA rounds differently under autograd)
        cond, neg = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=True, max_sequence_length=512)
    ours, null = encoder.encode(PROMPTS), encoder.encode([""])
    assert ours.tokens.shape == (2, 512, 32) and ours.pooled.shape == (2, 0)
    assert torch.equal(ours.tokens, cond) and torch.equal(null.tokens.expand(2, -1, -1), neg)

    noise, latents, videos = our_videos(wan_folder, PROMPTS)
    assert noise.shape == (2, 4, 2, 4, 4) and videos.shape == (2, FRAMES, 3, SIZE, SIZE)
    want_latents, want_videos = pipeline_videos(pipe, PROMPTS, noise)
    direct = pipe(PROMPTS[:1], latents=noise[:1].clone(), num_inference_steps=STEPS, guidance_scale=SCALE,
                  height=SIZE, width=SIZE, num_frames=FRAMES, output_type="latent").frames
    assert max_diff(direct, want_latents[:1]) <= 1e-5  # the callback saw the returned latents
    d_lat, d_vid = max_diff(latents, want_latents), max_diff(videos, want_videos)
    with capsys.disabled():
        print(f"\nwan vs WanPipeline: latents {d_lat:.2e} (|max| {latents.abs().max():.2f}), videos {d_vid:.2e}")
    assert d_lat <= 1e-5 and d_vid <= 1e-5
    assert videos.std() > 0.01  # a real video, not a constant


def test_codec_options_and_unipc_schedule(wan_folder, tmp_path):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    from pretrain.models.wan import pipeline as wan
    from pretrain.sampling import frame_strips
    from pretrain.schedule import shift_sigmas

    with pytest.raises(ValueError, match="model.options.num_frames"):
        load_exported(wan_folder, options={"num_frames": 6})
    with pytest.raises(ValueError, match="model.options.image_size"):
        load_exported(wan_folder, options={"image_size": 24})
    with pytest.raises(ValueError, match="model.options: unknown"):
        load_exported(wan_folder, options={"frames": 5})
    _, enc_a, codec, meta = load_exported(wan_folder, options={"num_frames": 9})
    assert codec.latent_shape(32, 48) == (4, 3, 4, 6) and meta["image_size"] == 480
    _, enc_b, _, _ = load_exported(wan_folder, options={"max_sequence_length": 16})
    assert enc_b.encode(PROMPTS[:1]).tokens.shape == (1, 16, 32)
    assert len({enc_a.cache_key, enc_b.cache_key}) == 2 and "/" not in enc_a.cache_key

    # encode: the posterior mean, normalised per channel by the folder's latents_mean / latents_std
    vae = AutoencoderKLWan.from_pretrained(wan_folder, subfolder="vae")
    videos = torch.rand(2, 9, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    z = codec.encode(videos)
    mean = vae.encode(videos.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mean
    m, s = (torch.tensor(vae.config[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    assert z.shape == (2, 4, 3, 2, 2) and max_diff(z, (mean - m) / s) <= 1e-6

    # Wan2.1's released scheduler: UniPC flow sigmas, first sigma exactly 1, final 0
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    got = wan.scheduler_sigmas(UniPCMultistepScheduler, unipc.config, 10)
    unipc.set_timesteps(10)
    want = shift_sigmas(torch.linspace(1.0, 1e-3, 11, dtype=torch.float64)[:-1], 3.0).float()
    assert got[0].item() == 1.0 and got[-1].item() == 0.0 and len(got) == 11
    assert torch.equal(got[1:], unipc.sigmas[1:]) and max_diff(got[:-1], want) <= 1e-6
    assert max_diff(wan.scheduler_sigmas(UniPCMultistepScheduler, unipc.config, 10, shift=5.0)[:-1],
                    shift_sigmas(torch.linspace(1.0, 1e-3, 11, dtype=torch.float64)[:-1], 5.0)) <= 1e-6

    # held-out grids of videos: frames 0, 1, 3, 4 of 5 side by side in each cell
    strips = frame_strips(videos[:, :5])
    assert torch.equal(strips, torch.cat([videos[:, i] for i in (0, 1, 3, 4)], dim=-1))

    index = json.loads((wan_folder / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    with pytest.raises(ValueError, match="Wan2.2"):
        wan.check_folder(tmp_path)


def test_schedule_option_shifts_a_flow_match_schedule_once(wan_folder):
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from pretrain.models.wan import pipeline as wan

    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # the fixture's scheduler
    euler.set_timesteps(10)
    assert torch.equal(wan.scheduler_sigmas(FlowMatchEulerDiscreteScheduler, euler.config, 10), euler.sigmas)
    euler.set_timesteps(sigmas=np.linspace(1.0, 1 / 1000, 10))
    single = load_exported(wan_folder, options={**OPTIONS, "schedule": "single_shift"})[0].sigmas(10)
    assert torch.equal(single, euler.sigmas) and abs(single[-2].item() - 1 / 334) < 1e-7
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    assert torch.equal(*(wan.scheduler_sigmas(UniPCMultistepScheduler, unipc.config, 10, schedule=s)
                         for s in ("pipeline", "single_shift")))  # UniPC's flow sigmas: shifted once already
    with pytest.raises(ValueError, match=r"model\.options\.schedule"):
        load_exported(wan_folder, options={"schedule": "twice"})


def _lora_rollout(folder):
    """The tiny model with a perturbed LoRA policy (train mode) and a rollout of 6 videos (3 prompts x
    group 2, in batches of 4 + 2)."""
    from pretrain.data.dataset import EncodedSet
    from tests.conftest import sampler_rollout
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, meta = load_exported(folder, options={**OPTIONS, "image_size": 16})
    captions = PROMPTS + ["a face", "the flag"]
    prompts = EncodedSet(torch.zeros(4, 3, 16, 16, dtype=torch.uint8), captions, encoder.encode(captions))
    null = encoder.encode([""])
    perturbed_lora_policy(model)
    model.eval()
    traj = sampler_rollout(model, codec, prompts, [0, 1, 2], group=2, batch=4, null=null, sigmas=model.sigmas(STEPS),
                           noise=NOISE, scale=SCALE, latent_shape=codec.latent_shape(16, 16))
    assert traj.latents.shape == (6, STEPS + 1, 4, 2, 2, 2) and traj.images.shape == (6, FRAMES, 3, 16, 16)
    return model.train(), traj


def test_video_rollout_log_probs_recomputed_in_training_equal_rollout(wan_folder, capsys):
    from rollout.sampler import log_prob

    model, traj = _lora_rollout(wan_folder)  # train mode, mini-batches of 3 (not the rollout's 4), CFG uncond detached
    deviations = []
    with torch.enable_grad():
        for start, t in itertools.product((0, 3), range(STEPS)):
            mb = traj.select(torch.arange(start, start + 3))
            ratio = torch.exp(log_prob(model, mb, t).log_prob - mb.log_probs[:, t])
            deviations.append((ratio - 1).abs().max().item())
    worst = torch.tensor(deviations).max().item()  # NaN propagates and fails the assertion below
    with capsys.disabled():
        print(f"\nwan video rollout: max |ratio - 1| in training = {worst:.2e}")
    assert worst <= 1e-5, worst


def test_gpu_preset_compiled_blocks_give_eager_log_probs_and_gradients(wan_folder, capsys):
    from tests.families.compiled import assert_compiled_matches_eager

    model, traj = _lora_rollout(wan_folder)
    assert_compiled_matches_eager(model, traj.select(torch.arange(3)), STEPS, "wan", 2, capsys)


if "test_video_brightness" not in REGISTRY:
    @register("test_video_brightness")
    def _video_brightness():
        """Mean brightness of videos ``[B, F, 3, H, W]`` in [0, 1] (images ``[B, 3, H, W]`` too)."""
        return lambda images, prompts=None, metadata=None: images.float().flatten(1).mean(1)


def test_grpo_iteration_exports_load_in_diffusers(wan_folder, tmp_path, capsys):
    from diffusers import WanPipeline
    from PIL import Image

    from posttrain.grpo.stage import train
    from pretrain.runtime.metrics import read_metrics

    cfg = grpo_config(tmp_path, wan_folder, "model.options.num_frames=5", "model.options.image_size=16",
                      "model.options.max_sequence_length=16", "data.limit=4", "train.steps=1",
                      "rollout.num_inference_steps=3", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "rollout.batch_size=4", "train.batch_size=4", "rollout.guidance_scale=4.5",
                      "rewards.jpeg_compressibility=0", "rewards.test_video_brightness=1.0", "optim.lr=3e-2",
                      "eval.grid_prompts=2", "eval.num_inference_steps=2", "eval.guidance_scale=4.5")
    export = train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert len(recs) == 1 and 0.0 < recs[0]["reward/test_video_brightness_mean"] < 1.0
    assert abs(recs[0]["ratio_min"] - 1) <= 1e-5 and abs(recs[0]["ratio_max"] - 1) <= 1e-5
    grid = Image.open(tmp_path / "grpo/samples/heldout_iter_00001.png")
    assert grid.size == (4 * 16 * 3, 16 * 3 + 12)  # 1 held-out prompt (limit 4 // 8): 4 frames of 16 px, 3x

    opts = {"max_sequence_length": 16}
    model, encoder, codec, meta = load_exported(export, options=opts)
    assert meta["image_size"] == 16 and codec.num_frames == FRAMES  # recorded options
    prompts = PROMPTS[:1]
    noise = initial_noise(1, codec.latent_shape(16, 16), 0)
    latents = sample_latents(model, encoder.encode(prompts), encoder.encode([""]), noise, 3, SCALE, None)
    ours = codec.decode(latents)
    kw = dict(size=16, steps=3, max_sequence_length=16)
    d_export = max_diff(pipeline_videos(WanPipeline.from_pretrained(export), prompts, noise, **kw)[1], ours)
    with_lora = WanPipeline.from_pretrained(wan_folder)
    with_lora.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_lora = max_diff(pipeline_videos(with_lora, prompts, noise, **kw)[1], ours)
    d_base = max_diff(pipeline_videos(WanPipeline.from_pretrained(wan_folder), prompts, noise, **kw)[1], ours)
    with capsys.disabled():
        print(f"\nwan GRPO export: WanPipeline(export) vs ours {d_export:.2e}; base + lora/ {d_lora:.2e}; "
              f"base (trained change) {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5
    assert d_base > 1e-4  # the iteration changed the model, so the two checks above are not vacuous


def test_real_wan21_config_loads(wan_folder):
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import ConfigError, load_config
    from pretrain.models.wan.codec import check_num_frames

    path = ROOT / "configs/grpo/wan21_t2v_1_3b.yaml"
    with pytest.raises(ConfigError, match="model.pretrained"):
        load_config(GRPOConfig, path)
    cfg = load_config(GRPOConfig, path, [f"model.pretrained={wan_folder}"])
    opts = cfg.model.options
    assert check_num_frames(opts["num_frames"], 4) == opts["num_frames"] and opts["image_size"] % 16 == 0
    assert 10 <= cfg.rollout.num_inference_steps <= 16 and cfg.policy.lora_rank > 0
    assert cfg.rollout.guidance_scale == 5.0 and cfg.train.precision == "bf16" and cfg.perf.preset == "gpu"
