"""A transformers ``CLIPModel`` + ``CLIPProcessor`` loaded from local folders, frozen, with the
embedding computations shared by ``clip_score``, ``pickscore`` and ``aesthetic``."""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.images import freeze, to_pil, torch_dtype
from pretrain.truncation import TruncationCounter, hf_token_counts


def _features(out) -> torch.Tensor:
    """transformers 5 returns a model output whose ``pooler_output`` is the projected embedding;
    older versions return the tensor itself."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class LocalCLIP:
    """A frozen ``CLIPModel`` read from ``path`` (a ``save_pretrained`` folder: ``config.json`` +
    weights) with its processor from ``processor_path`` (default: ``path``): the image processor
    (``preprocessor_config.json``) and, when ``text``, the tokenizer (as ``CLIPProcessor`` saves them).
    Prompts are cut at ``max_length`` tokens (start and end of text included: 75 BPE tokens of text at
    77); ``truncation`` counts the prompts of each :meth:`text_embeds` call that were longer, under the
    reward's ``name``. Loads local files only; ``FileNotFoundError`` naming the folder when one is
    missing."""

    def __init__(self, path: str, processor_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32", max_length: int = 77, text: bool = True, name: str = "clip"):
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

        for p in (path, processor_path or path):
            if not Path(p).is_dir():
                raise FileNotFoundError(f"CLIP folder not found: {p} (a save_pretrained folder is expected)")
        self.device = torch.device(device)
        self.model = freeze(CLIPModel.from_pretrained(path, local_files_only=True), self.device,
                            torch_dtype(dtype))
        self.image_processor = CLIPImageProcessor.from_pretrained(processor_path or path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(processor_path or path, local_files_only=True) if text else None
        self.max_length = max_length
        self.truncation = TruncationCounter(name, max_length)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """float ``[B, 3, H, W]`` in [0, 1] -> L2-normalised float32 ``[B, D]`` (PIL, then the
        processor's resize / centre crop / mean-std normalisation)."""
        pixels = self.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.model.dtype)
        emb = _features(self.model.get_image_features(pixel_values=pixels)).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """``B`` prompts -> L2-normalised float32 ``[B, D]`` (padded, truncated to ``max_length``; the
        truncated ones counted in ``truncation``)."""
        self.truncation.check(prompts, hf_token_counts(self.tokenizer, prompts))
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        tok = {k: v.to(self.device) for k, v in tok.items() if k in ("input_ids", "attention_mask")}
        emb = _features(self.model.get_text_features(**tok)).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """float32 ``[B]``: cosine similarity of image i with prompt i, in [-1, 1]."""
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1)
