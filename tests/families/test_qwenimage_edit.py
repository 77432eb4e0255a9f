"""Qwen-Image-Edit (``QwenImageEditPipeline``) on a tiny random folder: the source image read by the text
encoder (Qwen2.5-VL through its processor, the negative prompt too) and by the transformer (its latents
after the noisy ones). Our ODE sampler reproduces the pipeline given the same source, the rollout's
log-probs are recomputed with the recorded source, and a GRPO run on the shapes editing task exports a
folder and a LoRA that the pipeline loads."""

import json

import pytest
import torch

from pretrain.codec import encode_conditions
from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.conftest import grpo_config
from tests.families.test_qwenimage import build_tiny_qwenimage, pack

pytestmark = pytest.mark.core

SIZE, STEPS, SCALE, TOL = 32, 3, 4.0, 1e-5
OPTIONS = {"image_size": SIZE, "max_sequence_length": 512}
FAST = {**OPTIONS, "condition_area": 32 * 32}  # sources kept at 32 px (the pipeline resizes them to 1024)
PROMPTS = ["make the red circle blue", "make the square a triangle"]


def build_tiny_qwenimage_edit(path):
    """The tiny Qwen-Image folder's transformer, VAE and scheduler with a Qwen2.5-VL that knows the vision
    markers of its tokenizer and a ``Qwen2VLProcessor`` (2 x 2 patches, at most 256 pixels a source),
    saved as a ``QwenImageEditPipeline``."""
    from diffusers import QwenImageEditPipeline, QwenImagePipeline
    from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    from tests.families.tiny_tokenizers import IMAGE_PAD, VISION_END, VISION_START, qwen2_tokenizer

    base = QwenImagePipeline.from_pretrained(build_tiny_qwenimage(path.parent / f"{path.name}_t2i"))
    config = base.text_encoder.config
    config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = IMAGE_PAD, VISION_START, VISION_END
    torch.manual_seed(1)
    tokenizer, kw = qwen2_tokenizer(vision=True), dict(patch_size=2, temporal_patch_size=1, merge_size=1,
                                                        min_pixels=64, max_pixels=256)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**kw), video_processor=Qwen2VLVideoProcessor(**kw),
                                 tokenizer=tokenizer)
    QwenImageEditPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=Qwen2_5_VLForConditionalGeneration(config),
                          tokenizer=tokenizer, processor=processor, transformer=base.transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory):
    return build_tiny_qwenimage_edit(tmp_path_factory.mktemp("tiny_qwenimage_edit") / "pipeline")


def _sources(n=len(PROMPTS), seed=3):
    """8-bit source images as float [n, 3, SIZE, SIZE] in [0, 1] (what a data set's uint8 sources give)."""
    return (torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 255).round() / 255


def _pil(image):
    from PIL import Image

    return Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


def _ours(folder, sources, options=OPTIONS, prompts=PROMPTS):
    """Our Euler ODE (true CFG with each row's negative) from seed-0 noise: (noise, latents, images)."""
    model, encoder, codec, _ = load_exported(folder, options=options)
    embeds = encoder.encode_with_images(prompts, sources)
    embeds.images = encode_conditions(codec, sources)
    noise = initial_noise(len(prompts), codec.latent_shape(SIZE, SIZE), 0)
    latents = sample_latents(model.eval(), embeds, encoder.encode([""]), noise, STEPS, SCALE, None)
    return noise, latents, codec.decode(latents)


def _pipeline(pipe, sources, noise, prompts=PROMPTS):
    """The pipeline one prompt at a time (PIL sources, the empty negative prompt): latents, images."""
    latents, images = [], []

    def keep(_pipe, i, t, tensors):
        latents.append(tensors["latents"].clone())
        return {}

    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(prompts):
        images.append(pipe(image=_pil(sources[i]), prompt=[prompt], negative_prompt=[""], true_cfg_scale=SCALE,
                           latents=pack(noise[i:i + 1]), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                           output_type="pt", callback_on_step_end=keep).images)
    return torch.cat(latents[STEPS - 1::STEPS]), torch.cat(images)


def test_edit_sampler_reproduces_the_pipeline_with_the_source(edit_folder, tmp_path, capsys):
    from diffusers import QwenImageEditPipeline

    from pretrain.config import ConfigError

    model, encoder, codec, meta = load_exported(edit_folder, options=OPTIONS)
    assert meta["pipeline"] == "QwenImageEditPipeline" and model.takes_images and encoder.reads_images
    sources = _sources()
    embeds = encoder.encode_with_images(PROMPTS, sources)
    assert embeds.tokens.shape == (2, 512, 32) and embeds.negative.tokens.shape == (2, 512, 32)
    assert (embeds.negative.tokens[0] - embeds.negative.tokens[1]).abs().max() > 0  # the negative read the image
    assert encode_conditions(codec, sources).shape == (2, 4, 128, 128)  # resized to 1024 x 1024, as the pipeline
    noise, latents, images = _ours(edit_folder, sources)
    want_latents, want_images = _pipeline(QwenImageEditPipeline.from_pretrained(edit_folder), sources, noise)
    d_lat = (pack(latents) - want_latents).abs().max().item()
    d_img = (images - want_images).abs().max().item()
    with capsys.disabled():
        print(f"\nQwen-Image-Edit vs QwenImageEditPipeline: latents {d_lat:.2e}, images {d_img:.2e}")
    assert d_lat <= TOL and d_img <= TOL  # that the source moves the sample: the log-prob test below
    with pytest.raises(ValueError, match="Qwen-Image-Edit folder's prompts need their source images"):
        model(noise, torch.tensor([0.5, 0.5]), encoder.encode(PROMPTS))
    with pytest.raises(ConfigError, match="model.options.condition_area: 1024 is for Qwen-Image-Edit folders"):
        load_exported(build_tiny_qwenimage(tmp_path / "t2i"), options={**OPTIONS, "condition_area": 1024})


def test_log_probs_recomputed_with_the_recorded_source(edit_folder, capsys):
    from pretrain.data.dataset import EncodedSet, attach_codec
    from tests.conftest import sampler_rollout
    from tests.families.family_checks import recomputed_with_recorded_images
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, _ = load_exported(edit_folder, options=FAST)
    captions = PROMPTS + ["make the circle green"]
    conditions = (_sources(3) * 255).round().to(torch.uint8)
    data = EncodedSet(torch.zeros(3, 3, SIZE, SIZE, dtype=torch.uint8), captions, encoder.encode(captions), conditions)
    attach_codec(codec, data, encoder=encoder)
    perturbed_lora_policy(model)
    traj = sampler_rollout(model.eval(), codec, data, [0, 1, 2], group=2, batch=4, null=encoder.encode([""]),
                           sigmas=model.sigmas(STEPS), noise=0.7, scale=SCALE,
                           latent_shape=codec.latent_shape(SIZE, SIZE))
    rows = encoder.encode_with_images(captions, conditions.float() / 255)[torch.tensor([0, 0, 1, 1, 2, 2])]
    assert torch.equal(traj.embeds.tokens, rows.tokens) and torch.equal(traj.embeds.negative.tokens, rows.negative.tokens)
    worst, moved = recomputed_with_recorded_images(model, traj, STEPS)
    with capsys.disabled():
        print(f"\nQwen-Image-Edit GRPO: largest |ratio - 1| {worst:.2e}; with another source's latents the step's "
              f"mean moves by {moved:.2e} of its size")
    assert worst <= TOL and moved > 1e-3


@pytest.mark.long  # make test exports an editing pipeline for FLUX Kontext (test_flux_kontext.py)
def test_grpo_exports_an_edit_pipeline_and_lora(edit_folder, tmp_path, capsys):
    from diffusers import QwenImageEditPipeline
    from safetensors.torch import load_file

    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from rewards.base import REGISTRY

    # the mean brightness (random weights score every edit 0 by the judge: no advantage, no update)
    REGISTRY.register("test_edit_brightness", lambda: lambda images, prompts=None, metadata=None:
                      images.mean(dim=(1, 2, 3)), replace=True)
    export = grpo_train(grpo_config(
        tmp_path, edit_folder, f"rollout.guidance_scale={SCALE}", f"eval.guidance_scale={SCALE}",
        f"model.options.image_size={SIZE}", "model.options.max_sequence_length=512",
        f"model.options.condition_area={FAST['condition_area']}", "data.source=shapes_edit",
        "data.scenes=16", f"data.size={SIZE}", "data.heldout_per_category=2", "data.heldout_fraction=0.25",
        "data.layout=reading", "~rewards", "rewards={test_edit_brightness: 1.0}", "rollout.num_inference_steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4", "train.batch_size=4",
        "train.steps=1", "optim.lr=0.05", "eval.grid_prompts=2", "eval.num_inference_steps=2"))
    first = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    assert abs(first["ratio_min"] - 1) <= TOL and abs(first["ratio_max"] - 1) <= TOL, first
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"
    sources, one = _sources(1), PROMPTS[:1]  # the export at the pipeline's own 1024 x 1024 sources
    noise, _, ours = _ours(export, sources, {**OPTIONS, "condition_area": 1024 * 1024}, one)
    d_export = (_pipeline(QwenImageEditPipeline.from_pretrained(export), sources, noise, one)[1] - ours).abs().max().item()
    pipe = QwenImageEditPipeline.from_pretrained(edit_folder)
    pipe.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_lora = (_pipeline(pipe, sources, noise, one)[1] - ours).abs().max().item()
    moved = max(t.abs().max().item() for n, t in load_file(tmp_path / "grpo/lora/pytorch_lora_weights.safetensors").items()
                if "lora_B" in n)  # peft starts lora_B at 0: the iteration moved it
    with capsys.disabled():
        print(f"\nQwen-Image-Edit GRPO export: pipeline(export) vs ours {d_export:.2e}; base + LoRA {d_lora:.2e}; "
              f"largest lora_B {moved:.2e}")
    assert moved > 1e-4 and d_export <= TOL and d_lora <= TOL
