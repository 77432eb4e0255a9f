"""The FLUX family's own pixel-space preset: a ``FluxTransformer2DModel`` on 2x2-packed codec latents,
called as ``FluxPipeline`` calls it, pretrained, exported as a diffusers folder that loads back to the same
velocity, post-trained with Flow-GRPO (ratio 1 before the update) and with LoRA on both block kinds."""

import json

import pytest
import torch

from pretrain.export import load_exported
from pretrain.models import ModelConfig, build_backbone
from pretrain.models.flux import FluxPresetAdapter
from pretrain.text_encoder import PromptEmbeds
from tests.conftest import grpo_config, tiny_config

pytestmark = pytest.mark.core

SIZE, TEXT = 16, 384
FLUX = ["model.arch=flux", "model.preset=tiny", "codec.factor=2"]


def _tiny(**overrides) -> FluxPresetAdapter:
    torch.manual_seed(0)
    return build_backbone(ModelConfig(arch="flux", preset="tiny", overrides=overrides), SIZE, 12, TEXT, TEXT).eval()


def test_the_preset_is_called_as_the_flux_pipeline_calls_its_transformer():
    from diffusers import FluxPipeline, FluxTransformer2DModel

    model = _tiny()
    assert isinstance(model.transformer, FluxTransformer2DModel) and model.transformer.config.in_channels == 48
    g = torch.Generator().manual_seed(1)
    x, sigma = torch.randn(2, 12, SIZE, SIZE, generator=g), torch.tensor([0.25, 0.875])
    embeds = PromptEmbeds(torch.randn(2, 5, TEXT, generator=g), torch.randn(2, TEXT, generator=g))
    with torch.no_grad():
        ours = model(x, sigma, embeds)
        packed = model.transformer(  # FluxPipeline.__call__: timestep t / 1000 = sigma, ids as it builds them
            hidden_states=FluxPipeline._pack_latents(x, 2, 12, SIZE, SIZE), timestep=sigma, guidance=None,
            pooled_projections=embeds.pooled, encoder_hidden_states=embeds.tokens, txt_ids=torch.zeros(5, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, SIZE // 2, SIZE // 2, "cpu", torch.float32),
            return_dict=False)[0]
    assert torch.equal(ours, FluxPipeline._unpack_latents(packed, SIZE, SIZE, 1)) and ours.abs().mean() > 0.05
    assert torch.equal(model.sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    with pytest.raises(ValueError, match="model.preset: unknown preset 'huge' for arch flux"):
        build_backbone(ModelConfig(arch="flux", preset="huge"), SIZE, 12, TEXT, TEXT)
    with pytest.raises(ValueError, match="sample size 15 is odd"):
        build_backbone(ModelConfig(arch="flux", preset="tiny"), 15, 12, TEXT, TEXT)
    with pytest.raises(ValueError, match=r"axes_dims_rope: \[4, 4, 4\] sums to 12, not attention_head_dim 16"):
        _tiny(axes_dims_rope=[4, 4, 4])
    with pytest.raises(ValueError, match="guidance_embeds must be false"):
        FluxPresetAdapter(FluxTransformer2DModel(in_channels=48, num_layers=1, num_single_layers=1,
                                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                                                 pooled_projection_dim=8, guidance_embeds=True,
                                                 axes_dims_rope=(4, 6, 6)))


def test_pretrain_export_and_one_grpo_iteration_with_lora_on_both_block_kinds(tmp_path):
    from posttrain.grpo.stage import train as grpo_train
    from pretrain.runtime.metrics import read_metrics
    from pretrain.trainer import train

    export = train(tiny_config(tmp_path / "run", *FLUX, "train.steps=2", "train.batch_size=8", "eval.every=2",
                               "eval.heldout_samples=8", "data.limit=64"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run/pretrain/metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(0.3 < v < 5 for v in losses)  # rectified-flow loss of a fresh net ~ 2
    meta = json.loads((export / "posttrain.json").read_text())
    assert meta["arch"] == "flux" and json.loads((export / "config.json").read_text())["_class_name"] == \
        "FluxTransformer2DModel"
    model, _, codec, _ = load_exported(export)
    assert isinstance(model, FluxPresetAdapter) and codec.latent_shape(SIZE, SIZE) == (12, 8, 8)

    grpo_train(grpo_config(tmp_path / "run", export, "train.steps=1", "train.batch_size=16"))
    rec = read_metrics(tmp_path / "run/grpo/metrics.jsonl")[0]
    assert abs(rec["ratio_min"] - 1) <= 1e-5 and abs(rec["ratio_max"] - 1) <= 1e-5, rec
    assert torch.isfinite(torch.tensor([rec["reward_mean"], rec["grad_norm"]])).all() and rec["grad_norm"] > 0
    from safetensors.torch import load_file

    lora = load_file(str(next((tmp_path / "run/grpo/lora").rglob("*.safetensors"))))
    assert any("single_transformer_blocks" in k for k in lora) and any(".transformer_blocks." in k for k in lora)
    tuned, *_ = load_exported(tmp_path / "run/grpo/export")
    assert isinstance(tuned, FluxPresetAdapter)
    x, s = torch.randn(2, 12, 8, 8, generator=torch.Generator().manual_seed(3)), torch.tensor([0.4, 0.8])
    e = PromptEmbeds(torch.randn(2, 4, TEXT), torch.randn(2, TEXT))
    with torch.no_grad():
        assert not torch.equal(tuned(x, s, e), model(x, s, e))  # the update reached the export
