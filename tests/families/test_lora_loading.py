"""Our LoRA files load in diffusers with its default arguments at the trained strength: a preset's
``Policy.save_adapter`` folder with ``transformer.load_lora_adapter(folder)``, a real family's
``save_pipeline_lora`` folder with ``Pipeline.load_lora_weights(folder)`` and
``pipe.<component>.load_lora_adapter(folder)``. Each loaded denoiser gives the trained policy's output on
fixed inputs (within float32 rounding), as the LoRA-merged export does; with rank 4 and alpha 6, an
adapter loaded at alpha = rank would apply two thirds of the trained update."""

import copy

import pytest
import torch

from pretrain.text_encoder import PromptEmbeds
from tests.families.lora_policy import perturbed_lora_policy

pytestmark = pytest.mark.core

RANK, ALPHA = 4, 6.0
# float32 rounding, relative to the largest output when that exceeds 1 (the UNets' velocities reach ~40 at
# these sigmas; measured: at most 3.5e-7 of it, 0 where the weights load unchanged)
TOL = 1e-5
SAFETENSORS, BIN = "pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin"


def _fixed_inputs(shape: tuple[int, ...], embeds: PromptEmbeds) -> tuple:
    """(x [2, *shape], sigma [2], embeds): seeded, so every denoiser sees the same inputs."""
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(3))
    return x, torch.tensor([0.9, 0.4]), embeds


def _output(model, denoiser, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model.with_transformer(denoiser.eval())(*inputs)


def _trained(model, inputs):
    """LoRA (rank 4, alpha 6, B != 0) on ``model``: (base denoiser copy, policy, its output, the
    LoRA-merged copy's output minus it)."""
    base = copy.deepcopy(model.transformer).eval()
    policy = perturbed_lora_policy(model.eval(), rank=RANK, alpha=ALPHA)
    want = _output(model, model.transformer, inputs)
    merged = _output(model, policy.merged_transformer(), inputs)
    assert _diff(merged, want) <= TOL * _scale(want)
    assert _diff(want, _output(model, base, inputs)) > 1e-2  # the adapter really changes the output
    return base, policy, want, _diff(merged, want)


def _only_config(denoiser):
    (config,) = denoiser.peft_config.values()
    return config


def _default_adapter(model, denoiser, folder, inputs) -> torch.Tensor:
    """``denoiser.load_lora_adapter(folder)`` with no other argument (it reads ``pytorch_lora_weights.bin``:
    alpha = rank, the scale folded into lora_B); returns its output."""
    denoiser.load_lora_adapter(str(folder))
    config = _only_config(denoiser)
    assert (config.r, config.lora_alpha) == (RANK, RANK)
    return _output(model, denoiser, inputs)


def _named_adapter(model, denoiser, folder, inputs, prefix="transformer") -> torch.Tensor:
    """``denoiser.load_lora_adapter(folder, weight_name=<the safetensors>, prefix=prefix)`` (the default
    prefix is "transformer"): alpha read from the file's metadata; returns its output."""
    denoiser.load_lora_adapter(str(folder), weight_name=SAFETENSORS, prefix=prefix)
    config = _only_config(denoiser)
    assert (config.r, config.lora_alpha) == (RANK, ALPHA)
    return _output(model, denoiser, inputs)


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


def _scale(want) -> float:
    return max(1.0, want.abs().max().item())


PRESETS = {  # arch: (sample shape, text dim)
    "sd3": ((3, 16, 16), 32),
    "unet": ((3, 16, 16), 32),
    "wan": ((4, 2, 8, 8), 32),
}


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_preset_adapter_loads_with_load_lora_adapter_defaults(arch, tmp_path, capsys):
    from pretrain.models import ModelConfig, build_backbone

    shape, text = PRESETS[arch]
    torch.manual_seed(0)
    model = build_backbone(ModelConfig(arch=arch, preset="tiny"), shape[-1], shape[0], text, text)
    g = torch.Generator().manual_seed(4)
    inputs = _fixed_inputs(shape, PromptEmbeds(torch.randn(2, 6, text, generator=g), torch.randn(2, text, generator=g)))
    base, policy, want, d_merged = _trained(model, inputs)
    folder = policy.save_adapter(tmp_path / "lora")
    assert sorted(p.name for p in folder.iterdir()) == [BIN, SAFETENSORS]
    d_default = _diff(_default_adapter(model, copy.deepcopy(base), folder, inputs), want)
    d_named = _diff(_named_adapter(model, copy.deepcopy(base), folder, inputs), want)
    with capsys.disabled():
        print(f"\n{arch} preset LoRA vs the policy: load_lora_adapter(folder) {d_default:.1e}; "
              f"weight_name=safetensors {d_named:.1e}; merged {d_merged:.1e} (max |output| {_scale(want):.1f})")
    assert max(d_default, d_named) <= TOL * _scale(want)


def _sd3(root):
    from tests.families.test_sd3 import save_tiny_sd3

    return save_tiny_sd3(root / "pipe"), {}


def _flux(root):
    from tests.families.test_flux import save_tiny_flux

    return save_tiny_flux(root / "pipe"), {"image_size": 32}


def _wan(root):
    from tests.families.test_wan import OPTIONS, build_tiny_wan

    return build_tiny_wan(root / "pipe"), OPTIONS


def _sd(root):
    from tests.families.tiny_unet_pipelines import save_sd, schedulers

    return save_sd(root / "pipe", schedulers()["ddim_eps"]), {}


def _sdxl(root):
    from tests.families.tiny_unet_pipelines import save_sdxl, schedulers

    return save_sdxl(root / "pipe", schedulers()["euler_eps"]), {}


FAMILIES = {"sd3": _sd3, "flux": _flux, "wan": _wan, "sd": _sd, "sdxl": _sdxl}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_lora_loads_with_diffusers_defaults(family, tmp_path, capsys):
    import diffusers

    from pretrain.models.pipelines import load_pipeline, save_pipeline_lora

    folder, options = FAMILIES[family](tmp_path)
    model, encoder, codec, meta = load_pipeline(folder, options=options)
    size = meta["image_size"]
    inputs = _fixed_inputs(codec.latent_shape(size, size), encoder.encode(["a red apple", "the flag of a cat"]))
    _, _, want, d_merged = _trained(model, inputs)
    lora = save_pipeline_lora(model.transformer, meta, tmp_path / "lora")
    assert sorted(p.name for p in lora.iterdir()) == [BIN, SAFETENSORS]
    pipe_cls, comp = getattr(diffusers, meta["pipeline"]), meta["component"]

    pipe = pipe_cls.from_pretrained(folder)
    pipe.load_lora_weights(str(lora))
    config = _only_config(getattr(pipe, comp))
    assert (config.r, config.lora_alpha) == (RANK, ALPHA)  # alpha read from the file's metadata
    d_pipe = _diff(_output(model, getattr(pipe, comp), inputs), want)
    d_default = _diff(_default_adapter(model, getattr(pipe_cls.from_pretrained(folder), comp), lora, inputs), want)
    d_named = _diff(_named_adapter(model, getattr(pipe_cls.from_pretrained(folder), comp), lora, inputs, comp), want)
    with capsys.disabled():
        print(f"\n{family} ({meta['pipeline']}) LoRA vs the policy: load_lora_weights(folder) {d_pipe:.1e}; "
              f"{comp}.load_lora_adapter(folder) {d_default:.1e}; weight_name=safetensors, prefix={comp!r} "
              f"{d_named:.1e}; merged {d_merged:.1e} (max |output| {_scale(want):.1f})")
    assert max(d_pipe, d_default, d_named) <= TOL * _scale(want)
