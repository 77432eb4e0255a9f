"""``pickscore``: PickScore (Kirstain et al. 2023, "Pick-a-Pic", arXiv 2305.01569), a CLIP-H fine-tuned
on human preferences; score = logit_scale.exp() · cos(image, prompt), as in its reference code."""

from __future__ import annotations

import torch

from rewards.base import register
from rewards.clip_common import LocalCLIP
from rewards.images import check_images


@register("pickscore")
class PickScore:
    """score_i = exp(logit_scale) · cos(image_i, prompt_i): float32 ``[B]``, in [-s, s] with s the
    model's exp(logit_scale) (100 for the released PickScore_v1; its scores typically fall in 18 - 24).

    Args: ``path``: a local ``CLIPModel`` folder (a copy of yuvalkirstain/PickScore_v1);
    ``processor_path``: the ``CLIPProcessor`` folder (PickScore uses that of
    laion/CLIP-ViT-H-14-laion2B-s32B-b79K; default ``path``); ``device``; ``dtype``. Images float
    ``[B, 3, H, W]`` in [0, 1] with ``B`` prompts; prompts longer than 77 tokens are cut and counted in
    ``truncation`` (:class:`pretrain.truncation.TruncationCounter`). ``ValueError`` for a wrong shape or
    prompt count; ``FileNotFoundError`` for a missing folder."""

    def __init__(self, path: str, processor_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32"):
        self.clip = LocalCLIP(path, processor_path, device, dtype, name="pickscore")
        self.truncation = self.clip.truncation

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "pickscore")
        scale = self.clip.model.logit_scale.detach().float().exp().cpu()
        return (scale * self.clip.cosine(images, prompts).cpu()).float()
