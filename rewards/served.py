"""``served``: the client of ``posttrain serve-reward`` -- rewards hosted on another machine.

Posts ``{"images": [base64 PNG, ...], "prompts": [...]}`` to ``{url}/score`` in batches of
``batch_size`` (``max_concurrency`` batches in flight) and reads ``{"scores": [...], "raw": {name:
[...]}}``; JSON ``null`` decodes to NaN. Images are 8-bit PNG (``rewards.png``): the scores equal
in-process scoring of ``rewards.png.quantise(images)`` -- not of the float images -- with the same
reward config. ``metadata`` is not sent.
"""

from __future__ import annotations

import math

import torch

from rewards.base import register
from rewards.png import encode_png_b64
from rewards.transport import map_ordered, post_json


def decode_scores(values, n: int, where: str) -> list[float]:
    """A JSON list of ``n`` numbers or nulls -> floats (null -> NaN); ``RuntimeError`` naming
    ``where`` otherwise."""
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise RuntimeError(f"{where}: expected a list of {n} scores, got {got}")
    try:
        return [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"{where}: non-numeric score ({e})") from e


@register("served")
class ServedReward:
    """Reward computed by a ``posttrain serve-reward`` server.

    Args:
        url: the server root, e.g. ``http://10.0.0.5:8100`` (``/score`` is appended unless present).
        component: ``None`` returns the server's weighted sum (``scores``); a reward name returns that
            reward's raw score (``raw[name]``).
        batch_size: images per request. max_concurrency: requests in flight at once.
        timeout_s: per-request timeout (seconds). max_retries, backoff_s: bounded retries with
            exponential backoff (``rewards.transport``).

    ``__call__(images [B, 3, H, W] float32 in [0, 1], prompts list[str] of length B, metadata)`` ->
    float32 ``[B]`` in sample order (NaN where the server's reward gives NaN). Raises ``ValueError``
    for a bad shape or prompt count, ``RuntimeError`` naming the URL when the server is down, keeps
    failing, rejects the request, or answers with the wrong number of scores.
    """

    def __init__(self, url: str, component: str | None = None, batch_size: int = 32,
                 max_concurrency: int = 2, timeout_s: float = 300.0, max_retries: int = 3,
                 backoff_s: float = 0.5):
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"served reward: url must start with http:// or https://, got {url!r}")
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("served reward: need batch_size >= 1, max_concurrency >= 1, max_retries >= 0, "
                             "timeout_s > 0, backoff_s >= 0")
        url = str(url).rstrip("/")
        self.url = url if url.endswith("/score") else url + "/score"
        self.component, self.batch_size, self.max_concurrency = component, int(batch_size), int(max_concurrency)
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)

    def _score(self, batch, abort) -> list[float]:
        pngs, prompts = batch
        out = post_json(self.url, {"images": pngs, "prompts": prompts}, timeout_s=self.timeout_s,
                        max_retries=self.max_retries, backoff_s=self.backoff_s, abort=abort)
        if not isinstance(out, dict):
            raise RuntimeError(f"{self.url}: expected a JSON object, got {type(out).__name__}")
        if self.component is None:
            return decode_scores(out.get("scores"), len(pngs), f"{self.url} 'scores'")
        raw = out.get("raw") or {}
        if self.component not in raw:
            raise RuntimeError(f"{self.url}: no raw scores for '{self.component}'; it serves {sorted(raw)}")
        return decode_scores(raw[self.component], len(pngs), f"{self.url} 'raw.{self.component}'")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        prompts = list(prompts) if prompts is not None else []
        if len(prompts) != images.shape[0]:
            raise ValueError(f"served reward: {images.shape[0]} images but {len(prompts)} prompts")
        pngs, b = encode_png_b64(images), self.batch_size
        batches = [(pngs[i:i + b], prompts[i:i + b]) for i in range(0, len(pngs), b)]
        scores = map_ordered(self._score, batches, self.max_concurrency)
        return torch.tensor([s for chunk in scores for s in chunk], dtype=torch.float32)
