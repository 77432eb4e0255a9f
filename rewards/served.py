"""``served``: the client of ``posttrain serve-reward`` -- rewards hosted on another machine.

Posts ``{"images": [base64 PNG, ...], "prompts": [...]}`` to ``{url}/score`` in batches of
``batch_size`` (``max_concurrency`` batches in flight) and reads ``{"scores": [...], "raw": {name:
[...]}}``; JSON ``null`` decodes to NaN. Images are 8-bit PNG (``rewards.png``): the scores equal
in-process scoring of ``rewards.png.quantise(images)`` -- not of the float images -- with the same
reward config. ``metadata`` is not sent.

Every request carries ``Authorization: Bearer <token>`` when a token is configured: read from
``token_file``, else from the environment variable ``token_env`` (``POSTTRAIN_REWARD_TOKEN``, the
variable the server reads too). Built from a config, the client asks ``GET {url}/health`` once before
anything else (``check``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from rewards.base import register
from rewards.png import encode_png_b64
from rewards.transport import (Rejected, RewardUnavailable, checked_at_build, get_json, map_ordered, one_line,
                               post_json)

TOKEN_ENV = "POSTTRAIN_REWARD_TOKEN"


def read_token(token_file: str | Path | None, token_env: str | None = TOKEN_ENV) -> str | None:
    """The bearer token: the stripped text of ``token_file``, else the environment variable
    ``token_env``; ``None`` when neither is set (an empty variable counts as unset). ``ValueError``
    naming the file when it is missing, unreadable or empty."""
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"token file {path}: cannot read it ({type(e).__name__}: {e})") from e
        if not token:
            raise ValueError(f"token file {path}: empty")
        return token
    value = os.environ.get(token_env, "").strip() if token_env else ""
    return value or None


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


class ServedReward:
    """Reward computed by a ``posttrain serve-reward`` server.

    Args:
        url: the server root, e.g. ``http://10.0.0.5:8100`` (``/score`` is appended unless present).
        component: ``None`` returns the server's weighted sum (``scores``); a reward name returns that
            reward's raw score (``raw[name]``).
        batch_size: images per request (keep ``batch_size`` x PNG size under the server's body limit,
            64 MiB by default, and ``batch_size`` x H x W under its pixel limit, 64 Mi pixels).
        max_concurrency: requests in flight at once.
        timeout_s: per-request timeout (seconds). max_retries, backoff_s: bounded retries with
            exponential backoff (``rewards.transport``).
        token_file: file holding the server's bearer token; else the environment variable
            ``token_env``; no ``Authorization`` header when neither is set.

    ``__call__(images [B, 3, H, W] float32 in [0, 1], prompts list[str] of length B, metadata)`` ->
    float32 ``[B]`` in sample order (NaN where the server's reward gives NaN). Raises ``ValueError``
    for a bad shape or prompt count, ``RuntimeError`` naming the URL when the server is down, keeps
    failing, rejects the request (HTTP 4xx: a wrong token, a body or image over its limits), or answers
    with the wrong number of scores. Built by name from a ``rewards:`` config, ``check`` runs first.
    """

    def __init__(self, url: str, component: str | None = None, batch_size: int = 32,
                 max_concurrency: int = 2, timeout_s: float = 300.0, max_retries: int = 3,
                 backoff_s: float = 0.5, token_file: str | None = None, token_env: str | None = TOKEN_ENV):
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"served reward: url must start with http:// or https://, got {url!r}")
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("served reward: need batch_size >= 1, max_concurrency >= 1, max_retries >= 0, "
                             "timeout_s > 0, backoff_s >= 0")
        url = str(url).rstrip("/")
        self.url = url if url.endswith("/score") else url + "/score"
        self.health_url = self.url[:-len("/score")] + "/health"
        self.component, self.batch_size, self.max_concurrency = component, int(batch_size), int(max_concurrency)
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)
        token = read_token(token_file, token_env)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def check(self) -> dict:
        """``GET {url}/health`` once (with the retries; at most 10 s per attempt) and return its
        ``{"status": "ok", "rewards": {name: weight}}``. ``RewardUnavailable``, one line naming the URL,
        when the server is down or keeps failing, refuses the token (401), is not a ``posttrain
        serve-reward`` server, or does not serve ``component``."""
        where = f"served reward: {self.health_url}"
        try:
            health = get_json(self.health_url, timeout_s=min(self.timeout_s, 10.0), max_retries=self.max_retries,
                              backoff_s=self.backoff_s, headers=self.headers)
        except Rejected as e:
            hint = (f"; set token_file or ${TOKEN_ENV} to the server's token" if e.status == 401 else "")
            raise RewardUnavailable(one_line(f"served reward: start-up check failed: {e}{hint}")) from e
        except RuntimeError as e:
            raise RewardUnavailable(one_line(f"served reward: start-up check failed: {e}")) from e
        rewards = health.get("rewards") if isinstance(health, dict) else None
        if not isinstance(rewards, dict) or health.get("status") != "ok":
            raise RewardUnavailable(one_line(f"{where}: not a posttrain serve-reward server "
                                             f"(answered {str(health)[:200]})"))
        if self.component is not None and self.component not in rewards:
            raise RewardUnavailable(f"{where}: serves {sorted(rewards)}, not component '{self.component}'")
        return health

    def _score(self, batch, abort) -> list[float]:
        pngs, prompts = batch
        out = post_json(self.url, {"images": pngs, "prompts": prompts}, timeout_s=self.timeout_s,
                        max_retries=self.max_retries, backoff_s=self.backoff_s, headers=self.headers, abort=abort)
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


register("served")(checked_at_build(ServedReward))
