"""Tiny SD3 models and inputs shared by the distributed tests (seeded, so every rank builds the same)."""

from __future__ import annotations

import torch

from pretrain.models import ModelConfig
from pretrain.models.sd3 import SD3Adapter, build_transformer
from pretrain.text_encoder import PromptEmbeds

SIZE, CHANNELS, TEXT_DIM, POOLED_DIM, TEXT_LEN = 16, 3, 32, 32, 5


def tiny_model(seed: int = 0, preset: str = "tiny") -> SD3Adapter:
    """The ``preset`` SD3 transformer (16 px, 3 channels, patch 4: 16 image tokens) in an adapter."""
    torch.manual_seed(seed)
    return SD3Adapter(build_transformer(ModelConfig(preset=preset), SIZE, CHANNELS, TEXT_DIM, POOLED_DIM))


def tiny_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, PromptEmbeds, torch.Tensor]:
    """(x [n, 3, 16, 16], sigma [n], embeds (tokens [n, 5, 32], pooled [n, 32]), target v [n, 3, 16, 16])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CHANNELS, SIZE, SIZE, generator=g)
    sigma = torch.rand(n, generator=g)
    embeds = PromptEmbeds(torch.randn(n, TEXT_LEN, TEXT_DIM, generator=g), torch.randn(n, POOLED_DIM, generator=g))
    return x, sigma, embeds, torch.randn(n, CHANNELS, SIZE, SIZE, generator=g)


def flow_loss(model: torch.nn.Module, x, sigma, embeds, target) -> torch.Tensor:
    """Mean squared velocity error (float32), the pretraining objective's form."""
    return (model(x, sigma, embeds) - target).pow(2).mean()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (``DTensor.full_tensor()`` on sharded ones; collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (collective when sharded)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}
