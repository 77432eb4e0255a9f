"""``clip_score``: prompt-image alignment as the cosine similarity of CLIP embeddings (CLIPScore,
Hessel et al. 2021, arXiv 2104.08718)."""

from __future__ import annotations

import torch

from rewards.base import register
from rewards.clip_common import LocalCLIP
from rewards.images import check_images


@register("clip_score")
class ClipScore:
    """score_i = ``scale`` · cos(image_i, prompt_i), optionally clamped at 0 (``clamp_zero``).

    The defaults give the raw cosine in [-1, 1]; Hessel et al. define CLIPScore as 2.5·max(cos, 0)
    (``scale=2.5, clamp_zero=True``) and torchmetrics' ``CLIPScore`` reports 100·max(cos, 0)
    (``scale=100, clamp_zero=True``).

    Args: ``path``: a local ``CLIPModel`` folder (``save_pretrained`` layout, e.g. a copy of
    openai/clip-vit-large-patch14); ``processor_path``: the folder of its ``CLIPProcessor``
    (tokenizer + ``preprocessor_config.json``; default ``path``); ``device``; ``dtype`` of the model
    ("float32", "bfloat16", "float16"). Call: images float ``[B, 3, H, W]`` in [0, 1], ``B`` prompts ->
    float32 ``[B]``. Prompts longer than 77 tokens are cut (so they score as their first 77 tokens);
    ``truncation`` counts them per call (:class:`pretrain.truncation.TruncationCounter`). ``ValueError``
    for a wrong shape or prompt count; ``FileNotFoundError`` for a missing folder."""

    def __init__(self, path: str, processor_path: str | None = None, scale: float = 1.0,
                 clamp_zero: bool = False, device: str = "cpu", dtype: str = "float32"):
        self.clip = LocalCLIP(path, processor_path, device, dtype, name="clip_score")
        self.truncation = self.clip.truncation
        self.scale, self.clamp_zero = float(scale), bool(clamp_zero)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "clip_score")
        cos = self.clip.cosine(images, prompts)
        if self.clamp_zero:
            cos = cos.clamp(min=0)
        return (self.scale * cos).float().cpu()
