"""Shared input handling for model-backed rewards: checking the protocol's image batch, converting it
to PIL once, and freezing a reward model."""

from __future__ import annotations

import torch


def check_images(images: torch.Tensor, prompts: list[str] | None, name: str, need_prompts: bool = True) -> None:
    """``ValueError`` naming reward ``name`` unless ``images`` is ``[B, 3, H, W]`` and, when
    ``need_prompts``, ``prompts`` has ``B`` entries."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{name}: expects images float [B, 3, H, W] in [0, 1], got {shape}")
    if need_prompts and (prompts is None or len(prompts) != images.shape[0]):
        n = None if prompts is None else len(prompts)
        raise ValueError(f"{name}: expects one prompt per image, got {n} prompts for {images.shape[0]} images")


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """float ``[B, 3, H, W]`` in [0, 1] -> uint8 ``[B, 3, H, W]`` on the CPU (clamped, rounded to
    nearest): the one 8-bit conversion every reward and the HTTP transport use. ``ValueError`` for any
    other shape."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def to_pil(images: torch.Tensor) -> list:
    """float ``[B, 3, H, W]`` in [0, 1] (values outside are clamped) -> ``B`` RGB ``PIL.Image`` (uint8,
    rounded, as :func:`to_uint8`)."""
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images).permute(0, 2, 3, 1).contiguous().numpy()]


def freeze(module: torch.nn.Module, device: str | torch.device = "cpu",
           dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Move ``module`` to ``device`` (and ``dtype``), put it in eval mode and turn off its gradients."""
    module = module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
    module.eval()
    module.requires_grad_(False)
    return module


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; ``ValueError``
    otherwise."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: '{name}' is not one of {sorted(table)}")
    return table[name]
