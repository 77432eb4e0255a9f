"""FLUX.1 Kontext (``FluxKontextPipeline``) through the conditioning-image capability, on a tiny random
folder: the source image's latents ride with the prompt (``PromptEmbeds.images``), our ODE sampler
reproduces the pipeline given the same image, recomputed log-probs equal the rollout's and read the
recorded image, and a GRPO run on the shapes editing task exports a folder and a LoRA that
``FluxKontextPipeline`` loads with the same images."""

import json

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import sample_latents
from pretrain.text_encoder import PromptEmbeds
from tests.conftest import grpo_config
from tests.families.test_flux import GUIDANCE, MAX_LEN, OPTIONS, PROMPTS, SIZE, STEPS, TOL, _noise, save_tiny_flux

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    """The tiny FLUX folder's components saved as a ``FluxKontextPipeline``."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    root = tmp_path_factory.mktemp("kontext")
    flux = FluxPipeline.from_pretrained(save_tiny_flux(root / "flux"))
    FluxKontextPipeline(**flux.components).save_pretrained(root / "pipe")
    return root / "pipe"


def _sources(n=len(PROMPTS)):
    return torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))


def _pipeline(pipe, sources, noise, output_type):
    from diffusers import FluxPipeline

    pipe.set_progress_bar_config(disable=True)
    b, c, h, w = noise.shape
    out = pipe(prompt=PROMPTS, image=sources, latents=FluxPipeline._pack_latents(noise, b, c, h, w), height=SIZE,
               width=SIZE, max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               max_sequence_length=MAX_LEN, output_type=output_type).images
    return FluxPipeline._unpack_latents(out, SIZE, SIZE, pipe.vae_scale_factor) if output_type == "latent" else out


def _ours(folder, sources, noise, options=OPTIONS):
    model, encoder, codec, meta = load_exported(folder, options=options)
    text = encoder.encode(PROMPTS)
    embeds = PromptEmbeds(text.tokens, text.pooled, codec.encode(sources))
    latents = sample_latents(model.eval(), embeds, encoder.encode([""]), noise, STEPS,
                             guidance_scale=meta["sampling"]["guidance_scale"], shift=None)
    return latents, codec.decode(latents)


def test_kontext_sampler_reproduces_the_pipeline_with_the_source_image(kontext_dir, capsys):
    from diffusers import FluxKontextPipeline

    model, _, _, meta = load_exported(kontext_dir, options=OPTIONS)
    assert meta["family"] == "flux" and meta["pipeline"] == "FluxKontextPipeline" and model.takes_images
    noise, sources = _noise(), _sources()
    ours, our_images = _ours(kontext_dir, sources, noise)
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    theirs, images = _pipeline(pipe, sources, noise, "latent"), _pipeline(pipe, sources, noise, "pt")
    d_lat, d_img = (ours - theirs).abs().max().item(), (our_images - images).abs().max().item()
    other = _ours(kontext_dir, sources.flip(0), noise)[0]
    with capsys.disabled():
        print(f"\nFLUX Kontext ours vs FluxKontextPipeline: latents max |diff| {d_lat:.2e}, images {d_img:.2e}")
    assert d_lat <= TOL and d_img <= TOL
    assert (other - ours).abs().max() > 1e-3  # the source image reaches the denoiser


def test_a_flux1_folder_refuses_conditioning_images(tmp_path):
    model, encoder, codec, _ = load_exported(save_tiny_flux(tmp_path / "flux"), options=OPTIONS)
    text = encoder.encode(PROMPTS)
    embeds = PromptEmbeds(text.tokens, text.pooled, codec.encode(_sources()))
    with pytest.raises(ValueError, match="FluxAdapter: the prompts carry conditioning images"):
        model(_noise(), torch.tensor([0.5, 0.5]), embeds)


def test_log_probs_recomputed_with_the_recorded_source(kontext_dir, capsys):
    from pretrain.data.dataset import EncodedSet, attach_codec
    from tests.conftest import sampler_rollout
    from tests.families.family_checks import recomputed_with_recorded_images
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, _ = load_exported(kontext_dir, options=OPTIONS)
    captions = PROMPTS + ["a cat"]
    conditions = (_sources(3) * 255).round().to(torch.uint8)
    data = EncodedSet(torch.zeros(3, 3, SIZE, SIZE, dtype=torch.uint8), captions, encoder.encode(captions), conditions)
    attach_codec(codec, data)
    perturbed_lora_policy(model)
    traj = sampler_rollout(model.eval(), codec, data, [0, 1, 2], group=2, batch=4, null=encoder.encode([""]),
                           sigmas=model.sigmas(STEPS), noise=0.7, scale=1.0,
                           latent_shape=codec.latent_shape(SIZE, SIZE))
    # each rollout batch's distinct rows encoded once (batch sizes differ: float rounding), copied to their groups
    want = codec.encode(conditions.float() / 255)[[0, 0, 1, 1, 2, 2]]
    assert (traj.embeds.images - want).abs().max() <= 1e-6
    worst, moved = recomputed_with_recorded_images(model, traj, STEPS)
    with capsys.disabled():
        print(f"\nFLUX Kontext GRPO: largest |ratio - 1| {worst:.2e}; with another source image the step's mean "
              f"moves by {moved:.2e} of its size")
    assert worst <= 1e-5 and moved > 1e-3  # the recomputation reads the trajectory's source image


def test_grpo_on_the_editing_task_exports_a_kontext_pipeline_and_lora(kontext_dir, tmp_path, capsys):
    from diffusers import FluxKontextPipeline

    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from rewards.base import REGISTRY

    seen = []

    def brightness_with_source(images, prompts=None, metadata=None):
        """Mean brightness (random weights score every edit 0: no advantage); records the sources it got."""
        if metadata and "group_ids" in metadata:  # the rollout's batches
            seen.append(metadata["source_images"].shape)
        return images.mean(dim=(1, 2, 3))

    REGISTRY.register("test_brightness_with_source", lambda: brightness_with_source, replace=True)

    export = grpo_train(grpo_config(
        tmp_path, kontext_dir, "rollout.guidance_scale=1.0", "eval.guidance_scale=1.0",
        f"model.options.image_size={SIZE}",
        f"model.options.max_sequence_length={MAX_LEN}", "data.source=shapes_edit", "data.scenes=16",
        "data.size=32", "data.heldout_per_category=2", "data.heldout_fraction=0.25", "data.layout=reading",
        "~rewards", "rewards={test_brightness_with_source: 1.0}",
        "rollout.num_inference_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
        "train.batch_size=4", "train.steps=1", "optim.lr=0.05", "eval.grid_prompts=2", "eval.num_inference_steps=2"))
    assert seen and all(shape == (4, 3, SIZE, SIZE) for shape in seen)  # each rollout batch's sources, decoded
    first = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    assert abs(first["ratio_min"] - 1) <= 1e-5 and abs(first["ratio_max"] - 1) <= 1e-5, first
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    noise, sources = _noise(), _sources()
    ours = _ours(export, sources, noise, None)[1]  # options recorded in the export
    base = _ours(kontext_dir, sources, noise)[1]
    d_export = (_pipeline(FluxKontextPipeline.from_pretrained(export), sources, noise, "pt") - ours).abs().max().item()
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_lora = (_pipeline(pipe, sources, noise, "pt") - ours).abs().max().item()
    moved = (ours - base).abs().max().item()
    with capsys.disabled():
        print(f"\nFLUX Kontext GRPO export: pipeline(export) vs ours {d_export:.2e}; base + LoRA {d_lora:.2e}; "
              f"change from the base {moved:.2e}")
    assert moved > 1e-3 and d_export <= TOL and d_lora <= TOL
