"""``remote``: a VLM judge behind an OpenAI-compatible chat-completions server (how ``vllm serve``
exposes e.g. Qwen2.5-VL), as in DDPO's VLM-judged alignment reward.

One request per sample to ``{base_url}/chat/completions``: a user message holding the image as a
``data:image/png;base64,...`` ``image_url`` part (8-bit RGB PNG of the [0, 1] image, quantised once,
see ``rewards.png``) and the judging text ``prompt_template`` with ``{prompt}`` replaced by the
sample's prompt. The score is ``float(m.group(1))`` of the first match of ``score_pattern`` in
``choices[0].message.content`` (``group(0)`` when the pattern has no group), then optionally mapped
from ``score_range = [lo, hi]`` onto [0, 1] (clamped).

An answer with no match (or no text) scores NaN -- "not applicable", excluded from the statistics --
and is counted in ``unparsed_total`` with one warning per batch quoting the first such answer. A
server that is down or keeps failing raises ``RuntimeError`` naming the URL and the last error after
``1 + max_retries`` attempts (``rewards.transport``); nothing is ever filled with zeros.

Built from a config, the judge is asked one tiny question first (``check``: an 8x8 grey image), so a
server that is down, a wrong model name or a refused key fails at start-up in one line.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading

import torch

from rewards.base import register
from rewards.png import encode_png_b64
from rewards.transport import RewardUnavailable, checked_at_build, map_ordered, one_line, post_json

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = ('How well does this image match the description "{prompt}"? Rate it from 0 to 10. '
                    "Answer only with 'Score: <number>'.")
DEFAULT_PATTERN = r"[Ss]core\s*[:=]\s*([-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)"


class RemoteJudge:
    """Reward = a number parsed from a chat-completions judge's answer about each image.

    Args:
        base_url: the server's OpenAI API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name (``vllm serve`` uses the checkpoint name by default).
        prompt_template: judging text; ``{prompt}`` is replaced (plain substitution, other braces are
            kept as they are).
        score_pattern: regex; its first group (else the whole match) is parsed as a float.
        score_range: ``[lo, hi]`` maps a score linearly onto [0, 1], clamped; ``None`` keeps it raw.
        max_concurrency: requests in flight at once.
        timeout_s: per-request timeout (seconds).
        max_retries: retries per request after the first attempt (bounded exponential backoff from
            ``backoff_s``).
        api_key: bearer token; else read from the environment variable named ``api_key_env``; none
            sent when both are unset.
        max_tokens, temperature, system_prompt, extra_body: passed into the request (``extra_body``
            is merged into the JSON body, e.g. vLLM's ``guided_regex``).

    ``__call__(images [B, 3, H, W] float32 in [0, 1], prompts list[str] of length B, metadata)`` ->
    float32 ``[B]`` (NaN where the answer had no score). Raises ``ValueError`` for a bad shape or
    prompt count, ``RuntimeError`` when the server cannot be reached or keeps failing. Built by name
    from a ``rewards:`` config, ``check`` runs first.
    """

    def __init__(self, base_url: str, model: str, prompt_template: str = DEFAULT_TEMPLATE,
                 score_pattern: str = DEFAULT_PATTERN, score_range: list[float] | None = None,
                 max_concurrency: int = 8, timeout_s: float = 60.0, max_retries: int = 3,
                 backoff_s: float = 0.5, api_key: str | None = None, api_key_env: str | None = None,
                 max_tokens: int = 32, temperature: float = 0.0, system_prompt: str | None = None,
                 extra_body: dict | None = None):
        if not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"remote reward: base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("remote reward: need max_concurrency >= 1, max_retries >= 0, timeout_s > 0, "
                             "backoff_s >= 0")
        self.pattern = re.compile(score_pattern)
        if score_range is not None and (len(score_range) != 2 or score_range[1] == score_range[0]):
            raise ValueError(f"remote reward: score_range must be [lo, hi] with lo != hi, got {score_range}")
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self.model, self.template, self.score_range = model, prompt_template, score_range
        self.max_concurrency, self.timeout_s = int(max_concurrency), float(timeout_s)
        self.max_retries, self.backoff_s = int(max_retries), float(backoff_s)
        key = api_key or (os.environ.get(api_key_env) if api_key_env else None)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.body = {"max_tokens": max_tokens, "temperature": temperature, **(extra_body or {})}
        self.system_prompt = system_prompt
        self.unparsed_total = 0
        self._count_lock = threading.Lock()

    def check(self) -> str | None:
        """Ask the judge about one 8x8 grey image (one request, with the retries) and return its answer
        text, which need not contain a score. ``RewardUnavailable``, one line naming the URL, when the
        server is down or keeps failing, rejects the request (a wrong model name, a missing key) or
        answers without ``choices[0].message``."""
        grey = encode_png_b64(torch.full((1, 3, 8, 8), 0.5))[0]
        try:
            return self._ask((grey, "a grey square"), None)[1]
        except RuntimeError as e:
            raise RewardUnavailable(one_line(f"remote reward: start-up check failed: {e}")) from e

    def request(self, png_b64: str, prompt: str) -> dict:
        """The chat-completions JSON body for one image (base64 PNG) and its prompt."""
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}},
                   {"type": "text", "text": self.template.replace("{prompt}", prompt)}]
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {"model": self.model, "messages": messages, **self.body}

    def parse(self, answer: str | None) -> float:
        """The score in ``answer`` (mapped by ``score_range``), or NaN when the pattern does not match."""
        m = self.pattern.search(answer) if isinstance(answer, str) else None
        if m is None:
            return math.nan
        try:
            value = float(m.group(1) if self.pattern.groups else m.group(0))
        except ValueError:
            return math.nan
        if self.score_range is not None:
            lo, hi = self.score_range
            value = min(max((value - lo) / (hi - lo), 0.0), 1.0)
        return value

    def _ask(self, item, abort) -> tuple[float, str | None]:
        png, prompt = item
        out = post_json(self.url, self.request(png, prompt), timeout_s=self.timeout_s,
                        max_retries=self.max_retries, backoff_s=self.backoff_s, headers=self.headers,
                        abort=abort)
        try:
            answer = out["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"{self.url} answered without choices[0].message: {str(out)[:300]}") from e
        return self.parse(answer), answer

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        prompts = list(prompts) if prompts is not None else []
        if len(prompts) != images.shape[0]:
            raise ValueError(f"remote reward: {images.shape[0]} images but {len(prompts)} prompts")
        results = map_ordered(self._ask, list(zip(encode_png_b64(images), prompts)), self.max_concurrency)
        bad = [i for i, (score, _) in enumerate(results) if math.isnan(score)]
        if bad:
            with self._count_lock:
                self.unparsed_total += len(bad)
            log.warning("remote reward: %d/%d answers from %s had no score matching %r (scored NaN; "
                        "%d so far); first, sample %d: %r", len(bad), len(results), self.url,
                        self.pattern.pattern, self.unparsed_total, bad[0], str(results[bad[0]][1])[:200])
        return torch.tensor([score for score, _ in results], dtype=torch.float32)


register("remote")(checked_at_build(RemoteJudge))
