"""``hpsv2``: Human Preference Score v2 (Wu et al. 2023, arXiv 2306.09341): an OpenCLIP ViT-H/14
fine-tuned on the HPD v2 human-preference pairs; score = cos(image, prompt) of the normalised
OpenCLIP embeddings, as HPSv2's ``img_score.score`` computes it."""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.base import register
from rewards.images import check_images, freeze, to_pil
from pretrain.truncation import TruncationCounter, openclip_token_counts


@register("hpsv2")
class HPSv2:
    """score_i = <image_features_i, text_features_i> of the L2-normalised OpenCLIP embeddings, in
    [-1, 1] (the released HPS v2 / v2.1 give about 0.2 - 0.35 on generated images). float32 ``[B]``.

    Args: ``checkpoint``: the HPS weights file (``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt``: a
    ``torch.save`` dict with ``state_dict``, or a bare state dict; a ``module.`` prefix is stripped);
    ``model_name``: the OpenCLIP architecture (``ViT-H-14`` for HPS v2); ``model_config``: optionally an
    OpenCLIP model-config JSON file (``embed_dim``, ``vision_cfg``, ``text_cfg``), registered under its
    file stem, which then is the architecture used; ``device``; ``precision`` (OpenCLIP's: fp32,
    bf16, fp16, amp, ...). Images go through OpenCLIP's validation transform (resize, centre crop,
    OpenAI mean/std); prompts through the architecture's tokenizer (bundled BPE, no download), cut at
    its context length (77 tokens with start and end of text for ViT-H-14) and counted per call in
    ``truncation`` (:class:`pretrain.truncation.TruncationCounter`). ``FileNotFoundError`` for a
    missing file; ``ValueError`` for a wrong image shape or prompt count."""

    def __init__(self, checkpoint: str, model_name: str = "ViT-H-14", model_config: str | None = None,
                 device: str = "cpu", precision: str = "fp32"):
        import open_clip

        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"hpsv2: checkpoint not found: {checkpoint}")
        if model_config is not None:
            if not Path(model_config).is_file():
                raise FileNotFoundError(f"hpsv2: model config not found: {model_config}")
            open_clip.add_model_config(model_config)
            model_name = Path(model_config).stem
        self.device = torch.device(device)
        model, _, self.preprocess = open_clip.create_model_and_transforms(
            model_name, pretrained=checkpoint, precision=precision, device=self.device, output_dict=True)
        self.model = freeze(model, self.device)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.truncation = TruncationCounter("hpsv2", int(getattr(self.tokenizer, "context_length", None) or 77))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "hpsv2")
        dtype = next(self.model.parameters()).dtype
        pixels = torch.stack([self.preprocess(im) for im in to_pil(images)]).to(self.device, dtype)
        self.truncation.check(prompts, openclip_token_counts(self.tokenizer, list(prompts)))
        out = self.model(pixels, self.tokenizer(list(prompts)).to(self.device))
        return (out["image_features"].float() * out["text_features"].float()).sum(-1).cpu()
