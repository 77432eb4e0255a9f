"""Tensor parallelism of SD3, FLUX, Wan and Qwen-Image (``pretrain/parallel/tensor.py`` with each family's plan):
TP = 2 on 2 ranks, and TP = 2 x FSDP = 2 on 4 ranks (with activation checkpointing), equal one process -- forward outputs within 1e-5,
LoRA gradients within 1e-5 relative, and after an optimizer step the gathered adapter weights."""

import pytest
import torch
from peft import LoraConfig

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from pretrain.text_encoder import PromptEmbeds
from tests.distributed.common import full_grads, full_params

pytestmark = pytest.mark.core

TEXT_DIM = 32


def sd3():
    """The tiny SD3 preset with SD3.5's per-head q / k RMS norm and a second attention in block 0."""
    from pretrain.models import ModelConfig
    from pretrain.models.sd3 import SD3Adapter, build_transformer
    from tests.distributed.common import CHANNELS, POOLED_DIM, SIZE, tiny_batch

    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", overrides={"qk_norm": "rms_norm", "dual_attention_layers": [0]})
    model = SD3Adapter(build_transformer(cfg, SIZE, CHANNELS, TEXT_DIM, POOLED_DIM))
    x, sigma, embeds, target = tiny_batch(4)
    return model, (x, sigma, embeds), target


def flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from pretrain.models.flux.pipeline import FluxAdapter

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                         pooled_projection_dim=TEXT_DIM, guidance_embeds=True,
                                         axes_dims_rope=(4, 6, 6))
    model = FluxAdapter(transformer, FlowMatchEulerDiscreteScheduler(), image_seq_len=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, 8, 8, generator=g)  # packed 2x2: 16 tokens of 16 channels
    embeds = PromptEmbeds(torch.randn(4, 6, TEXT_DIM, generator=g), torch.randn(4, TEXT_DIM, generator=g))
    return model, (x, torch.rand(4, generator=g), embeds), torch.randn(4, 4, 8, 8, generator=g)


def wan():
    from pretrain.models.wan import WanVideoAdapter, build_wan_transformer

    torch.manual_seed(0)
    model = WanVideoAdapter(build_wan_transformer("tiny", {}, 12, TEXT_DIM))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 12, 2, 8, 8, generator=g)
    embeds = PromptEmbeds(torch.randn(4, 5, TEXT_DIM, generator=g), torch.zeros(4, 0))
    return model, (x, torch.rand(4, generator=g), embeds), torch.randn(4, 12, 2, 8, 8, generator=g)


def qwenimage():
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from pretrain.models.qwenimage import QwenImageAdapter

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6))
    model = QwenImageAdapter(transformer, FlowMatchEulerDiscreteScheduler(), image_seq_len=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, 8, 8, generator=g)
    tokens = torch.randn(4, 6, TEXT_DIM, generator=g)
    tokens[0, 4:] = 0  # one prompt shorter than the rest: the batch is masked
    embeds = PromptEmbeds(tokens, torch.zeros(4, 0))
    return model, (x, torch.rand(4, generator=g), embeds), torch.randn(4, 4, 8, 8, generator=g)


def flux2():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from pretrain.models.flux2 import Flux2Adapter

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=False)
    model = Flux2Adapter(transformer, FlowMatchEulerDiscreteScheduler(), image_seq_len=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 4, 4, generator=g)  # patchified latents: 16 tokens of 16 channels
    embeds = PromptEmbeds(torch.randn(4, 6, 48, generator=g), torch.zeros(4, 0))
    return model, (x, torch.rand(4, generator=g), embeds), torch.randn(4, 16, 4, 4, generator=g)


FAMILIES = {"sd3": sd3, "flux": flux, "wan": wan, "qwenimage": qwenimage, "flux2": flux2}


def with_lora(model):
    """Frozen base, LoRA r 4 on the family's attention projections and its MLPs (colwise and rowwise
    layers both), B random so every gradient is non-zero."""
    model.requires_grad_(False)
    targets = list(model.lora_targets) + ["net.0.proj", "net.2", "proj_mlp"]
    torch.manual_seed(3)  # lora_A's init draws from the global generator
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                             target_modules=targets))
    g = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """(largest relative difference max|a - b| / max|b| over the tensors of ``b``, its name)."""
    return max((float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)), k) for k in b)


def _tp_equals_one_process(rank, world, family, lora, dp_shard, checkpointing=False):
    mesh = ParallelDims(dp_shard=dp_shard, tp=2).build_mesh()
    model, inputs, target = FAMILIES[family]()
    ref, _, _ = FAMILIES[family]()
    if lora:
        model, ref = with_lora(model), with_lora(ref)
    parallelize(model, mesh, ParallelConfig(activation_checkpointing=checkpointing))  # TP, (AC,) FSDP2
    sharded = sum(type(p).__name__ == "DTensor" and "Shard" in str(p.placements) for p in model.parameters())
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2) if dp_shard > 1 else slice(0, 4)
    x, sigma, embeds = inputs
    out = model(x[rows], sigma[rows], embeds[rows])
    out_ref = ref(*inputs)
    (out - target[rows]).pow(2).mean().backward()
    (out_ref - target).pow(2).mean().backward()
    grads, want = full_grads(model), full_grads(ref)
    trained = [p for p in model.parameters() if p.requires_grad]
    torch.optim.SGD(trained, lr=0.1).step()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1).step()
    params, params_ref = full_params(model), full_params(ref)
    heads = [m.heads for m in model.transformer.modules() if hasattr(m, "heads") and hasattr(m, "to_q")]
    return dict(sharded=sharded, heads=sorted(set(heads)), same_names=set(grads) == set(want),
                n_grads=len(want), out_diff=float((out - out_ref[rows]).abs().max().detach()),
                out_max=float(out_ref.abs().max()), grad_rel=rel_diff(grads, want)[0], worst=rel_diff(grads, want)[1],
                param_diff=max(float((params[k] - params_ref[k]).abs().max()) for k in params_ref))


@pytest.mark.parametrize("family,lora", [  # make test: SD3 and Qwen-Image with LoRA; make test-all: every family
    pytest.param("sd3", True, id="lora-sd3"), pytest.param("qwenimage", True, id="lora-qwenimage"),
    *(pytest.param(f, lora, id=f"{'lora' if lora else 'full'}-{f}", marks=pytest.mark.long)
      for f in ("sd3", "flux", "wan", "qwenimage") for lora in (True, False)
      if (f, lora) not in (("sd3", True), ("qwenimage", True)))])
def test_tp2_equals_one_process(family, lora):
    for r in run_ranks(_tp_equals_one_process, family, lora, 1):
        print(family, lora, r)
        # 2 heads: one per TP rank (Qwen-Image's processor keeps the global count and splits by width)
        assert r["sharded"] > 0 and r["heads"] == [2 if family == "qwenimage" else 1]
        assert r["same_names"] and r["n_grads"] > 0
        assert r["out_diff"] <= 1e-5 * max(1.0, r["out_max"]), r
        assert r["grad_rel"] <= 1e-5, r
        assert r["param_diff"] <= 1e-5, r


@pytest.mark.long  # 4 ranks; make test keeps TP 2 and FSDP 2 apart
@pytest.mark.parametrize("family", ["sd3", "flux", "wan", "qwenimage"])
def test_tp2_x_fsdp2_equals_one_process(family):
    """4 ranks, 2 data shards of 2 samples; activation checkpointing between TP and FSDP2 (torchtitan's order)."""
    for r in run_ranks(_tp_equals_one_process, family, True, 2, True, world_size=4):
        print(family, r)
        assert r["sharded"] > 0 and r["same_names"]
        assert r["out_diff"] <= 1e-5 * max(1.0, r["out_max"]), r
        assert r["grad_rel"] <= 1e-5, r
        assert r["param_diff"] <= 1e-5, r
