"""A model family added from outside the project: a toy diffusers denoiser, its adapter and presets,
registered with ``register_family`` in this file only, pretrained through ``pretrain.trainer.train``
(``model.arch=toy``) and post-trained for one GRPO iteration on its export."""

import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin

from posttrain.grpo.stage import train as grpo_train
from pretrain.backbone import Backbone
from pretrain.export import load_exported
from pretrain.models import FAMILIES, Family, denoiser_blocks, register_family, unregister_family
from pretrain.parallel.sequence import enable_sequence_parallel
from pretrain.runtime.metrics import read_metrics
from pretrain.text_encoder import PromptEmbeds
from pretrain.trainer import train as pretrain
from tests.conftest import grpo_config, tiny_config

pytestmark = pytest.mark.core

NAME = "toy"
PRESETS = {"tiny": dict(hidden=16, num_layers=2), "small": dict(hidden=32, num_layers=3)}


class ToyBlock(torch.nn.Module):
    """Residual conv block modulated (scale, shift) by the conditioning vector."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.GroupNorm(1, hidden)
        self.mod = torch.nn.Linear(hidden, 2 * hidden)
        self.conv = torch.nn.Conv2d(hidden, hidden, 3, padding=1)

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.mod(cond)[:, :, None, None].chunk(2, 1)
        return h + self.conv(F.silu(self.norm(h) * (1 + scale) + shift))


class ToyDenoiser(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """``forward(x [B, C, h, w], sigma [B], tokens [B, L, text_dim]) -> velocity [B, C, h, w]``."""

    @register_to_config
    def __init__(self, channels: int = 3, text_dim: int = 32, hidden: int = 16, num_layers: int = 2):
        super().__init__()
        self.proj_in = torch.nn.Conv2d(channels, hidden, 1)
        self.time_proj = torch.nn.Linear(8, hidden)
        self.text_proj = torch.nn.Linear(text_dim, hidden)
        self.layers = torch.nn.ModuleList(ToyBlock(hidden) for _ in range(num_layers))
        self.proj_out = torch.nn.Conv2d(hidden, channels, 1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        angles = sigma[:, None] * torch.arange(1, 5, device=x.device, dtype=x.dtype) * torch.pi
        cond = self.time_proj(torch.cat([angles.sin(), angles.cos()], 1)) + self.text_proj(tokens.mean(1))
        h = self.proj_in(x)
        for layer in self.layers:
            h = layer(h, F.silu(cond))
        return self.proj_out(h)


class ToyAdapter(Backbone):
    """``forward(x, sigma [B] in [0, 1], embeds) -> velocity`` float32; the denoiser takes sigma as is."""

    lora_targets = ["mod"]
    block_attrs = ("layers",)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        sigma = sigma.to(x.device, torch.float32).expand(x.shape[0])
        return self.transformer(x.to(dtype), sigma.to(dtype), embeds.tokens.to(x.device, dtype)).float()


@pytest.fixture
def toy_family():
    """Registers the toy family for one test and removes it afterwards; yields the (denoiser, initial
    weights) pairs its build function made."""
    standard = dict(FAMILIES)
    built = []

    def build(cfg, sample_size, channels, text_dim, pooled_dim):
        if cfg.pretrained:
            return ToyDenoiser.from_pretrained(cfg.pretrained)
        if cfg.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset '{cfg.preset}' for arch {NAME}")
        denoiser = ToyDenoiser(channels=channels, text_dim=text_dim, **{**PRESETS[cfg.preset], **cfg.overrides})
        built.append((denoiser, {k: v.clone() for k, v in denoiser.state_dict().items()}))
        return denoiser

    register_family(NAME, Family(ToyAdapter, ToyDenoiser, PRESETS, build))
    try:
        yield built
    finally:
        unregister_family(NAME)
        assert FAMILIES == standard


def test_registered_family_is_reached_through_its_adapter(toy_family):
    with pytest.raises(ValueError, match="already registered"):
        register_family(NAME, FAMILIES[NAME])
    denoiser = ToyDenoiser(hidden=8, num_layers=3)
    assert denoiser_blocks(denoiser) == list(denoiser.layers)  # what FSDP2 / compile would wrap
    with pytest.raises(ValueError, match="sequence parallel: ToyAdapter has no sequence-parallel plan"):
        enable_sequence_parallel(ToyAdapter(denoiser))


def test_custom_family_pretrains_exports_and_post_trains(toy_family, tmp_path):
    export = pretrain(tiny_config(tmp_path / "run", f"model.arch={NAME}", "train.steps=3", "eval.every=0"))
    ((trained, initial),) = toy_family
    assert any(not torch.equal(v, initial[k]) for k, v in trained.state_dict().items())  # it was trained
    losses = [r["loss"] for r in read_metrics(tmp_path / "run/pretrain/metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert json.loads((export / "posttrain.json").read_text())["arch"] == NAME

    # the export loads back through the registry as the toy family, with the trained velocity
    model, encoder, codec, meta = load_exported(export)
    assert isinstance(model, ToyAdapter) and type(model.transformer) is ToyDenoiser
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *codec.latent_shape(meta["image_size"], meta["image_size"]), generator=g)
    sigma, embeds = torch.tensor([0.3, 0.9]), encoder.encode(["a red apple", "a blue car"])
    with torch.no_grad():
        v_loaded, v_trained = model(x, sigma, embeds), ToyAdapter(trained.eval())(x, sigma, embeds)
    assert torch.equal(v_loaded, v_trained) and v_loaded.abs().max() > 1e-3

    # one GRPO iteration with one optimizer step: the first ratio is measured on-policy
    grpo_train(grpo_config(tmp_path / "run", export, "train.steps=1", "train.batch_size=16"))
    rec = read_metrics(tmp_path / "run/grpo/metrics.jsonl")[0]
    print(losses, rec)
    assert abs(rec["ratio_min"] - 1) <= 1e-5 and abs(rec["ratio_max"] - 1) <= 1e-5, rec
    assert torch.isfinite(torch.tensor([rec["reward_mean"], rec["grad_norm"]])).all() and rec["grad_norm"] > 0
    post = tmp_path / "run/grpo/export"
    assert json.loads((post / "posttrain.json").read_text())["arch"] == NAME
    tuned, *_ = load_exported(post)
    with torch.no_grad():
        v_tuned = tuned(x, sigma, embeds)
    assert type(tuned.transformer) is ToyDenoiser and not torch.equal(v_tuned, v_loaded)  # the update moved it
