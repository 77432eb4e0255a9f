"""``ocr``: text rendering accuracy read back with Tesseract (Debian ``tesseract-ocr`` through
``pytesseract``), the OCR reward of Flow-GRPO (Liu et al. 2025, arXiv 2505.05470) with Tesseract in
place of PaddleOCR."""

from __future__ import annotations

import re
import shutil

import torch

from rewards.base import register
from rewards.edit_distance import levenshtein
from rewards.images import check_images, to_pil

_DOUBLE = re.compile(r'"([^"]*)"')
_SINGLE = re.compile(r"(?<!\w)'([^']*)'(?!\w)")  # not an apostrophe inside a word (don't, rock 'n')


def ocr_target(prompt: str) -> str:
    """The text an image for ``prompt`` should show: the double-quoted spans joined by spaces, else
    the single-quoted ones, else the whole prompt."""
    for pattern in (_DOUBLE, _SINGLE):
        spans = pattern.findall(prompt)
        if spans:
            return " ".join(spans)
    return prompt


def _normalise(text: str, case_sensitive: bool) -> str:
    text = "".join(text.split())
    return text if case_sensitive else text.lower()


def text_score(read: str, target: str, case_sensitive: bool = False, substring: bool = True) -> float:
    """1 - min(d, n) / n, with d the Levenshtein distance between the OCR output and the target and n
    the target's length, both without whitespace (and lower-cased unless ``case_sensitive``); in
    [0, 1]. ``substring``: a target found inside the OCR output scores 1 (stray marks read around the
    text are not penalised, as in Flow-GRPO). NaN when the target has nothing to read."""
    read, target = _normalise(read, case_sensitive), _normalise(target, case_sensitive)
    if not target:
        return float("nan")
    if substring and target in read:
        return 1.0
    return 1.0 - min(levenshtein(read, target), len(target)) / len(target)


@register("ocr")
class OCR:
    """Per image: Tesseract reads the image, the score is ``text_score(read, ocr_target(prompt))``:
    float32 ``[B]`` in [0, 1], NaN for a prompt with nothing to read.

    Args: ``lang``: Tesseract language (``eng``); ``config``: extra Tesseract flags (default
    ``--psm 6``, one block of text); ``min_side``: images whose shorter side is below this are
    upscaled (bicubic) to it before reading (Tesseract needs glyphs ~20 px tall); ``case_sensitive``;
    ``substring``; ``tesseract_cmd``: the binary (default ``tesseract`` on PATH). ``RuntimeError`` at
    construction when the ``tesseract`` binary is missing, :class:`pretrain.extras.MissingExtra` when
    ``pytesseract`` is (``pip install 'posttrain[ocr]'``); ``ValueError`` for a wrong image shape or
    prompt count."""

    def __init__(self, lang: str = "eng", config: str = "--psm 6", min_side: int = 256,
                 case_sensitive: bool = False, substring: bool = True, tesseract_cmd: str | None = None):
        from pretrain.extras import require

        pytesseract = require("pytesseract", "the ocr reward")
        cmd = tesseract_cmd or pytesseract.pytesseract.tesseract_cmd
        if shutil.which(cmd) is None:
            raise RuntimeError(f"ocr: the Tesseract binary '{cmd}' is not found; install the Debian package "
                               f"tesseract-ocr (apt-get install tesseract-ocr), or pass tesseract_cmd")
        pytesseract.pytesseract.tesseract_cmd = cmd  # pytesseract keeps the command in a module global
        self._tess = pytesseract
        self.lang, self.config, self.min_side = lang, config, int(min_side)
        self.case_sensitive, self.substring = bool(case_sensitive), bool(substring)

    def read(self, image) -> str:
        """The text Tesseract reads in one RGB ``PIL.Image`` (upscaled to ``min_side`` first)."""
        from PIL import Image

        short = min(image.size)
        if short < self.min_side:
            f = self.min_side / short
            image = image.resize((round(image.width * f), round(image.height * f)), Image.BICUBIC)
        return self._tess.image_to_string(image, lang=self.lang, config=self.config)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "ocr")
        scores = []
        for image, prompt in zip(to_pil(images), prompts):
            target = ocr_target(prompt)
            if not _normalise(target, True):
                scores.append(float("nan"))  # nothing to read: skip Tesseract
                continue
            scores.append(text_score(self.read(image), target, self.case_sensitive, self.substring))
        return torch.tensor(scores, dtype=torch.float32)
