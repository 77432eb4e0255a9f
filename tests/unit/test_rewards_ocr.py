"""ocr: target extraction and the edit-distance score (pure), then Tesseract reading text rendered with
Pillow. The Tesseract tests fail (never skip) when ``CI`` is set and Tesseract or the font is missing."""

import importlib.util
import math
import os
import shutil
import subprocess

import pytest
import torch

from rewards.base import build_reward
from rewards.edit_distance import levenshtein
from rewards.ocr import ocr_target, text_score

pytestmark = pytest.mark.core


@pytest.mark.parametrize("prompt,target", [
    ('a neon sign that says "Open Late"', "Open Late"),
    ("a mug with 'coffee' printed on it", "coffee"),
    ('"big" and "sale" on a poster', "big sale"),
    ("don't panic", "don't panic"),                           # apostrophes are not quotes
    ("the cat's sign reads 'meow' in red", "meow"),
    ("stop", "stop"),
])
def test_target_is_the_quoted_text_else_the_prompt(prompt, target):
    assert ocr_target(prompt) == target


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2 and levenshtein("same", "same") == 0


def test_text_score():
    assert text_score("Hello", "hello") == 1.0                  # case-insensitive by default
    assert text_score("HELL0", "hello") == pytest.approx(0.8)   # one substitution in five
    assert text_score("HELL0", "hello", case_sensitive=True) == 0.0
    assert text_score("| hello ~", "hello") == 1.0               # stray marks around the word
    assert text_score("| hello ~", "hello", substring=False) == pytest.approx(1 - 2 / 5)  # "|hello~": 2 edits
    assert text_score("completely different text", "hi") == 0.0  # capped at 0
    assert text_score("h e l l o", "hello") == 1.0               # whitespace is ignored
    assert math.isnan(text_score("anything", "  "))


def test_missing_tesseract_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="Tesseract binary .* is not found; install the Debian package tesseract-ocr"):
        build_reward("ocr", tesseract_cmd=str(tmp_path / "no-tesseract"))


def _font_path():
    try:
        out = subprocess.run(["fc-match", "-f", "%{file}", "DejaVu Sans:style=Book"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    for path in (out, "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
        if path and path.lower().endswith(".ttf") and os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="module")
def ocr_env():
    """(reward, font path); fails, naming what to install, when Tesseract or the font is missing
    (`make test` installs both as root)."""
    missing = []
    if shutil.which("tesseract") is None:
        missing.append("the tesseract binary (Debian tesseract-ocr)")
    if importlib.util.find_spec("pytesseract") is None:
        missing.append("the pytesseract package")
    font = _font_path()
    if font is None:
        missing.append("a DejaVu Sans TTF (Debian fonts-dejavu-core)")
    if missing:
        pytest.fail("ocr tests need " + ", ".join(missing) + " (as root: apt-get install -y tesseract-ocr "
                    "fonts-dejavu-core)")
    return build_reward("ocr"), font


def render(words, font_path, size=(96, 320)):
    """float32 [N, 3, H, W] in [0, 1]: each word in black, 48 px DejaVu Sans, on white."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(font_path, 48)
    out = []
    for word in words:
        im = Image.new("RGB", (size[1], size[0]), "white")
        ImageDraw.Draw(im).text((16, 18), word, font=font, fill="black")
        out.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255)
    return torch.stack(out)


def test_tesseract_reads_rendered_words(ocr_env):
    reward, font = ocr_env
    images = render(["hello", "hello", "hello", "world", "hello"], font)
    prompts = ['a sign that says "hello"', "hello",  'a sign that says "help"',
               'a sign that says "hello"', 'an empty sign ""']
    got = reward(images, prompts)
    assert got.shape == (5,) and got.dtype == torch.float32
    assert got[0] == 1.0 and got[1] == 1.0                  # exact word: quoted, then the whole prompt
    assert 0 < got[2] < 1 and got[2] == pytest.approx(0.5)  # "help" vs "hello": 2 edits over 4 letters
    assert got[3] < got[0] and got[3] < 0.5                 # wrong word
    assert math.isnan(got[4])                               # nothing to read
    assert torch.equal(reward(images, prompts).nan_to_num(-1), got.nan_to_num(-1))


def test_ocr_rejects_a_batch_without_prompts(ocr_env):
    reward, font = ocr_env
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(render(["hi"], font), None)
