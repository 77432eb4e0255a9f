"""Prompt-only data for post-training real models: a text file of prompts (one per line), or a folder
with ``train.txt`` and ``test.txt`` (Flow-GRPO's prompt-set layout), encoded batch by batch.

Large text encoders (T5-XXL, UMT5) give ~1-5 MB of float32 states per prompt, so the whole set is never
encoded up front: :class:`LazyEmbeds` encodes the rows a batch asks for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.data.folder import DatasetError
from pretrain.text_encoder import PromptEmbeds


def read_prompt_file(path: Path) -> list[str]:
    """Non-blank, stripped lines of ``path``. Raises ``DatasetError`` naming the file if it is missing
    or holds no prompt."""
    if not path.is_file():
        raise DatasetError(f"data.path: prompt file '{path}' not found")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise DatasetError(f"data.path: '{path}' holds no prompt (one per line expected)")
    return prompts


def load_prompts(path: str | None) -> tuple[list[str], list[str] | None]:
    """(train prompts, held-out prompts or None). ``path``: a ``.txt`` file (held-out split left to the
    caller) or a folder with ``train.txt`` and optionally ``test.txt``. ``DatasetError`` naming
    ``data.path`` otherwise."""
    if not path:
        raise DatasetError("data.path: required when data.source is 'prompts' (a .txt file or a folder "
                           "with train.txt / test.txt)")
    p = Path(path)
    if p.is_dir():
        test = p / "test.txt"
        return read_prompt_file(p / "train.txt"), (read_prompt_file(test) if test.is_file() else None)
    return read_prompt_file(p), None


class LazyEmbeds:
    """Prompt embeddings computed when indexed: ``lazy[idx]`` (a ``LongTensor`` or list of row indices)
    returns ``encoder.encode`` of those prompts as :class:`PromptEmbeds` (float32, on the encoder's
    output device)."""

    def __init__(self, encoder, prompts: list[str]):
        self.encoder, self.prompts = encoder, prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx) -> PromptEmbeds:
        rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        return self.encoder.encode([self.prompts[i] for i in rows])


def blank_images(n: int, size: int) -> torch.Tensor:
    """uint8 ``[n, 3, size, size]`` zeros as a broadcast view (no memory per prompt): prompt-only sets
    carry no images, only their resolution."""
    return torch.zeros(1, 3, size, size, dtype=torch.uint8).expand(n, -1, -1, -1)
