"""Wan image-to-video (``WanImageToVideoPipeline`` without an image encoder: Wan2.2 I2V-A14B's layout, and
one transformer) through the conditioning-image capability, on tiny random folders: our ODE sampler
reproduces the pipeline given the same first frame, the rollout's log-probs are recomputed with the
recorded frame, and a GRPO run exports a folder and a LoRA that the pipeline loads."""

import json

import pytest
import torch

from pretrain.codec import decode_conditions, encode_conditions
from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from pretrain.text_encoder import PromptEmbeds
from tests.conftest import grpo_config
from tests.families.test_wan import FRAMES, PROMPTS, SCALE, STEPS, build_tiny_wan, max_diff

pytestmark = pytest.mark.core

SIZE = 32
OPTIONS = {"num_frames": FRAMES, "image_size": SIZE, "max_sequence_length": 16}
TOL = 1e-5


def build_tiny_i2v(path, boundary_ratio: float | None = None):
    """The tiny Wan folder's text encoder, tokenizer, VAE and scheduler as a ``WanImageToVideoPipeline``
    whose transformer (and ``transformer_2`` with ``boundary_ratio``) takes 2 z + 4 = 12 input channels."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    base = WanPipeline.from_pretrained(build_tiny_wan(path.parent / f"{path.name}_t2v"))
    torch.manual_seed(2)
    config = {**base.transformer.config, "in_channels": 2 * base.vae.config.z_dim + 4}
    first = WanTransformer3DModel.from_config(config)
    second = WanTransformer3DModel.from_config(config) if boundary_ratio else None
    WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                            scheduler=base.scheduler, transformer=first, transformer_2=second,
                            boundary_ratio=boundary_ratio).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def i2v_folder(tmp_path_factory):
    return build_tiny_i2v(tmp_path_factory.mktemp("tiny_wan_i2v") / "pipeline")


def _frames(n=len(PROMPTS), seed=3):
    return torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def _ours(folder, frames, options=OPTIONS):
    """Our Euler ODE from seed-0 noise with each prompt's first frame: (noise, latents, videos)."""
    model, encoder, codec, _ = load_exported(folder, options=options)
    text = encoder.encode(PROMPTS)
    embeds = PromptEmbeds(text.tokens, text.pooled, encode_conditions(codec, frames))
    noise = initial_noise(len(PROMPTS), codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model.eval(), embeds, encoder.encode([""]), noise, STEPS, SCALE, None)
    return noise, latents, codec.decode(latents)


def _pipeline(pipe, frames, noise):
    """The pipeline one prompt at a time (it repeats one image over a batch): the final latents (from its
    step-end callback) and the videos."""
    latents, videos = [], []

    def keep(_pipe, i, t, tensors):
        latents.append(tensors["latents"].clone())
        return {}

    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(PROMPTS):
        videos.append(pipe(image=frames[i:i + 1], prompt=[prompt], latents=noise[i:i + 1].clone(),
                           num_inference_steps=STEPS, guidance_scale=SCALE, height=SIZE, width=SIZE,
                           num_frames=FRAMES, max_sequence_length=16, output_type="pt",
                           callback_on_step_end=keep).frames)
    return torch.cat(latents[STEPS - 1::STEPS]), torch.cat(videos)


@pytest.mark.parametrize("boundary_ratio", [None, pytest.param(0.8, marks=pytest.mark.long)])  # A14B: test-all
def test_i2v_sampler_reproduces_the_pipeline_with_the_first_frame(boundary_ratio, tmp_path, capsys):
    from diffusers import WanImageToVideoPipeline

    folder = build_tiny_i2v(tmp_path / "pipeline", boundary_ratio)
    model, _, codec, meta = load_exported(folder, options=OPTIONS)
    assert meta["pipeline"] == "WanImageToVideoPipeline" and model.takes_images
    frames = _frames()
    cond = encode_conditions(codec, frames)
    assert cond.shape == (2, 4 + 4, 2, 4, 4) and torch.equal(cond[:, :4, 0], torch.ones(2, 4, 4, 4))
    assert cond[:, :4, 1:].abs().max() == 0 and decode_conditions(codec, cond).shape == (2, 3, SIZE, SIZE)
    noise, latents, videos = _ours(folder, frames)
    want_latents, want_videos = _pipeline(WanImageToVideoPipeline.from_pretrained(folder), frames, noise)
    d_lat, d_vid = max_diff(latents, want_latents), max_diff(videos, want_videos)
    other = _ours(folder, frames.flip(0))[1]
    with capsys.disabled():
        print(f"\nWan I2V (boundary_ratio {boundary_ratio}) vs WanImageToVideoPipeline: latents {d_lat:.2e}, "
              f"videos {d_vid:.2e}")
    assert d_lat <= TOL and d_vid <= TOL
    assert max_diff(other, latents) > 1e-3  # the first frame reaches the denoiser


def test_refusals_name_the_variant(i2v_folder, tmp_path):
    from diffusers import WanImageToVideoPipeline

    from pretrain.backbone import ConditioningError
    from pretrain.config import ConfigError
    from tests.families.test_wan import build_tiny_wan

    t2v, _, codec, _ = load_exported(build_tiny_wan(tmp_path / "t2v"), options=OPTIONS)
    text = load_exported(i2v_folder, options=OPTIONS)[1].encode(PROMPTS)
    embeds = PromptEmbeds(text.tokens, text.pooled, torch.zeros(2, 8, 2, 4, 4))
    with pytest.raises(ConditioningError, match="WanAdapter: the prompts carry conditioning images"):
        t2v(torch.zeros(2, 4, 2, 4, 4), torch.tensor([0.5, 0.5]), embeds)
    model = load_exported(i2v_folder, options=OPTIONS)[0]
    with pytest.raises(ConditioningError, match=r"WanAdapter: conditions \(2, 8, 2, 4, 4\) for latents \(2, 4, 2, 2, 2\)"):
        model(torch.zeros(2, 4, 2, 2, 2), torch.tensor([0.5, 0.5]), embeds)
    with pytest.raises(ConditioningError, match="image-to-video folder's prompts need their first frames"):
        model(torch.zeros(2, 4, 2, 4, 4), torch.tensor([0.5, 0.5]), PromptEmbeds(text.tokens, text.pooled))
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_folder)
    pipe.register_to_config(expand_timesteps=True)
    pipe.save_pretrained(tmp_path / "ti2v")
    with pytest.raises(ConfigError, match="expand_timesteps .*TI2V-5B"):
        load_exported(tmp_path / "ti2v", options=OPTIONS)


def test_log_probs_recomputed_with_the_recorded_first_frame(i2v_folder, capsys):
    from pretrain.data.dataset import EncodedSet, attach_codec
    from tests.conftest import sampler_rollout
    from tests.families.family_checks import recomputed_with_recorded_images
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, _ = load_exported(i2v_folder, options=OPTIONS)
    captions = PROMPTS + ["a dog running"]
    conditions = (_frames(3) * 255).round().to(torch.uint8)
    data = EncodedSet(torch.zeros(3, FRAMES, 3, SIZE, SIZE, dtype=torch.uint8), captions, encoder.encode(captions),
                      conditions)
    attach_codec(codec, data)
    perturbed_lora_policy(model)
    traj = sampler_rollout(model.eval(), codec, data, [0, 1, 2], group=2, batch=4, null=encoder.encode([""]),
                           sigmas=model.sigmas(STEPS), noise=0.7, scale=SCALE,
                           latent_shape=codec.latent_shape(SIZE, SIZE))
    want = encode_conditions(codec, conditions.float() / 255)[[0, 0, 1, 1, 2, 2]]  # distinct rows, then copies
    assert (traj.embeds.images - want).abs().max() <= 1e-6 and traj.sources.shape == (6, 3, SIZE, SIZE)
    worst, moved = recomputed_with_recorded_images(model, traj, STEPS)
    with capsys.disabled():
        print(f"\nWan I2V GRPO: largest |ratio - 1| {worst:.2e}; with another first frame the step's mean moves by "
              f"{moved:.2e} of its size")
    assert worst <= TOL and moved > 1e-3  # the recomputation reads the trajectory's first frame


def test_grpo_exports_an_i2v_pipeline_and_lora(i2v_folder, tmp_path, capsys):
    from diffusers import WanImageToVideoPipeline

    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from rewards.base import REGISTRY

    seen = []

    def brightness_with_first_frame(videos, prompts=None, metadata=None):
        """Mean brightness of each video; records the first frames it got with the rollout's batches."""
        if metadata and "group_ids" in metadata:
            seen.append(metadata["source_images"].shape)
        return videos.mean(dim=(1, 2, 3, 4))

    REGISTRY.register("test_brightness_with_first_frame", lambda: brightness_with_first_frame, replace=True)
    export = grpo_train(grpo_config(
        tmp_path, i2v_folder, f"rollout.guidance_scale={SCALE}", f"eval.guidance_scale={SCALE}",
        f"model.options.image_size={SIZE}", f"model.options.num_frames={FRAMES}", "model.options.max_sequence_length=16",
        "data.source=shapes_edit", "data.scenes=16", f"data.size={SIZE}", "data.heldout_per_category=2",
        "data.heldout_fraction=0.25", "data.layout=reading", "~rewards", "rewards={test_brightness_with_first_frame: 1.0}",
        "rollout.num_inference_steps=3", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
        "train.batch_size=4", "train.steps=1", "optim.lr=3e-2", "eval.grid_prompts=2", "eval.num_inference_steps=2"))
    assert seen and all(shape == (4, 3, SIZE, SIZE) for shape in seen)
    first = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    assert abs(first["ratio_min"] - 1) <= TOL and abs(first["ratio_max"] - 1) <= TOL, first
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    frames = _frames()
    noise, _, ours = _ours(export, frames, None)  # the options recorded in the export
    base = _ours(i2v_folder, frames)[2]
    d_export = max_diff(_pipeline(WanImageToVideoPipeline.from_pretrained(export), frames, noise)[1], ours)
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_folder)
    pipe.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_lora = max_diff(_pipeline(pipe, frames, noise)[1], ours)
    moved = max_diff(ours, base)
    with capsys.disabled():
        print(f"\nWan I2V GRPO export: pipeline(export) vs ours {d_export:.2e}; base + LoRA {d_lora:.2e}; change "
              f"from the base {moved:.2e}")
    assert moved > 1e-4 and d_export <= TOL and d_lora <= TOL
