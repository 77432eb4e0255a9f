"""The timestep a denoiser receives keeps its pipeline's precision, with bf16 weights: SD3 and Wan get
float32 timesteps (as ``StableDiffusion3Pipeline`` / ``WanPipeline`` pass them; the transformers cast
after the sinusoid), never timesteps rounded to bf16 (960.129 -> 960, 602.151 -> 604 on SD3's shift-3
ten-step schedule); FLUX gets bf16 ones, because ``FluxPipeline`` casts before dividing by 1000. The
timestep a trajectory records is the one fed. (UNet timesteps are the scheduler's integers, exact in
float32: not at stake.)"""

from pathlib import Path

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import sample_latents
from pretrain.text_encoder import PromptEmbeds
from tests.families.test_sd3 import PROMPTS, SIZE, save_tiny_sd3

pytestmark = pytest.mark.core

STEPS, SCALE = 10, 4.5
# the shift-3 ten-step schedule's timesteps (sigma * 1000), as the pipeline's scheduler computes them
SHIFT3_TEN = [1000.0, 960.129, 913.349, 857.692, 790.368, 707.279, 602.151, 464.876, 278.049, 8.929]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_bf16") / "pipe")  # scheduler shift 3


def _record(transformer, calls: list):
    """Keep each forward's keyword inputs and its output."""
    def pre(mod, args, kwargs):
        calls.append({k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)})

    def post(mod, args, kwargs, out):
        calls[-1]["out"] = out[0].detach().clone()
    return [transformer.register_forward_pre_hook(pre, with_kwargs=True),
            transformer.register_forward_hook(post, with_kwargs=True)]


def test_sd3_in_bf16_feeds_the_pipeline_s_float32_timesteps(folder, capsys):
    from diffusers import StableDiffusion3Pipeline

    noise = torch.randn(len(PROMPTS), 16, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(1))
    model, encoder, _, _ = load_exported(folder, options={"dtype": "bfloat16"})
    model.eval()
    ours: list = []
    hooks = _record(model.transformer, ours)
    lat = sample_latents(model, encoder.encode(PROMPTS), encoder.encode([""]), noise, STEPS, SCALE, shift=None)
    for h in hooks:
        h.remove()
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    theirs: list = []
    _record(pipe.transformer, theirs)
    with torch.no_grad():
        want = pipe(prompt=PROMPTS, latents=noise.to(torch.bfloat16), num_inference_steps=STEPS,
                    guidance_scale=SCALE, height=SIZE, width=SIZE, output_type="latent").images
    fed = torch.stack([c["timestep"][0] for c in ours])
    assert fed.dtype == torch.float32 and len(ours) == len(theirs) == STEPS
    assert torch.equal(fed, torch.stack([c["timestep"][0] for c in theirs]))
    assert fed.tolist() == pytest.approx(SHIFT3_TEN, abs=5e-4)
    assert torch.equal(model.timestep(model.sigmas(STEPS)[:-1]), fed)  # what a trajectory records
    # each of the pipeline's calls, given to our adapter: the very same velocity
    sigmas = model.sigmas(STEPS)
    with torch.no_grad():
        for t, call in enumerate(theirs):
            x = call["hidden_states"]
            v = model(x, sigmas[t].expand(x.shape[0]), PromptEmbeds(call["encoder_hidden_states"],
                                                                    call["pooled_projections"]))
            assert torch.equal(v, call["out"].float()), t
    d_lat = (lat - want.float()).abs().max().item()
    with capsys.disabled():
        print(f"\nsd3 bf16 ODE ({STEPS} steps, shift 3) vs StableDiffusion3Pipeline bf16: max |latents diff| "
              f"{d_lat:.4f} of max |latents| {want.float().abs().max().item():.3f}")
    assert d_lat < 0.05  # the rest is the pipeline's bf16 latents between steps (ours stay float32)


def _fed(transformer, run) -> torch.Tensor:
    """The ``timestep`` input of each of ``transformer``'s forwards during ``run()``, stacked (first row)."""
    seen: list = []
    h = transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].detach().clone()),
                                              with_kwargs=True)
    with torch.no_grad():
        run()
    h.remove()
    return torch.stack([t.reshape(-1)[0] for t in seen])


def test_flux_in_bf16_feeds_the_pipeline_s_bf16_timesteps(tmp_path):
    """FluxPipeline itself casts ``t`` to the latents' dtype before / 1000: FLUX keeps that rounding, and
    the timestep a trajectory records is the one fed."""
    from diffusers import FluxPipeline

    from tests.families.test_flux import GUIDANCE, MAX_LEN, OPTIONS, PROMPTS as FLUX_PROMPTS, SIZE as FLUX_SIZE
    from tests.families.test_flux import save_tiny_flux

    folder = save_tiny_flux(tmp_path / "flux")
    model, encoder, _, _ = load_exported(folder, options={**OPTIONS, "dtype": "bfloat16"})
    noise = torch.randn(2, 16, FLUX_SIZE // 4, FLUX_SIZE // 4, generator=torch.Generator().manual_seed(0))
    cond, null = encoder.encode(FLUX_PROMPTS), encoder.encode([""])
    ours = _fed(model.transformer, lambda: sample_latents(model.eval(), cond, null, noise, 4, GUIDANCE, shift=None))
    pipe = FluxPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    packed = FluxPipeline._pack_latents(noise.to(torch.bfloat16), 2, 16, FLUX_SIZE // 4, FLUX_SIZE // 4)
    theirs = _fed(pipe.transformer, lambda: pipe(FLUX_PROMPTS, latents=packed, num_inference_steps=4,
                                                  guidance_scale=GUIDANCE, height=FLUX_SIZE, width=FLUX_SIZE,
                                                  max_sequence_length=MAX_LEN, output_type="latent"))
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    assert torch.equal(model.timestep(model.sigmas(4)[:-1]), ours.float())  # the record is what was fed


def test_wan_in_bf16_feeds_the_pipeline_s_float32_timesteps(tmp_path):
    from diffusers import WanPipeline

    from tests.families.test_wan import FRAMES, OPTIONS as WAN_OPTIONS, PROMPTS as WAN_PROMPTS, SCALE as WAN_SCALE
    from tests.families.test_wan import build_tiny_wan

    folder = build_tiny_wan(tmp_path / "wan")
    model, encoder, codec, meta = load_exported(folder, options={**WAN_OPTIONS, "dtype": "bfloat16"})
    size = meta["image_size"]
    noise = torch.randn(2, *codec.latent_shape(size, size), generator=torch.Generator().manual_seed(0))
    cond, null = encoder.encode(WAN_PROMPTS), encoder.encode([""])
    ours = _fed(model.transformer, lambda: sample_latents(model.eval(), cond, null, noise, 4, WAN_SCALE, None))
    pipe = WanPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    theirs = _fed(pipe.transformer, lambda: pipe(WAN_PROMPTS, latents=noise.to(torch.bfloat16), num_inference_steps=4,
                                                 guidance_scale=WAN_SCALE, height=size, width=size,
                                                 num_frames=FRAMES, output_type="latent"))
    theirs = theirs[::2]  # WanPipeline runs the conditional and the unconditional branch as two calls
    assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs)
    assert torch.equal(model.timestep(model.sigmas(4)[:-1]), ours)
