"""``remote``: a VLM judge behind an OpenAI-compatible chat-completions server (how ``vllm serve``
exposes e.g. Qwen2.5-VL), as in DDPO's VLM-judged alignment reward.

One request per sample to ``{base_url}/chat/completions``: a user message holding the image as a
``data:image/png;base64,...`` ``image_url`` part (8-bit RGB PNG of the [0, 1] image, quantised once,
see ``rewards.png``) and the judging text ``prompt_template`` with ``{prompt}`` replaced by the
sample's prompt. The score is ``float(m.group(1))`` of the first match of ``score_pattern`` in
``choices[0].message.content`` (``group(0)`` when the pattern has no group), then optionally mapped
from ``score_range = [lo, hi]`` onto [0, 1] (clamped).

An answer with no match (or no text) scores NaN -- "not applicable", excluded from the statistics --
and is counted in ``unparsed_total`` with one warning per batch quoting the first such answer.

``scoring`` other than ``text`` reads the answer's first token's log-probs instead of its text (the
request asks for ``logprobs`` and ``top_logprobs``; Flow-Factory's vLLM evaluation scores the same way):
``yes_prob`` is P(yes) = sum of p over ``yes_tokens`` / (that + sum of p over ``no_tokens``), among the
top log-probs; ``expected_score`` is sum v p(v) / sum p(v) over the ``score_tokens`` (token -> value)
among them, then mapped by ``score_range``. Tokens are compared without surrounding whitespace. A reply
without log-probs, or whose top log-probs hold none of the tokens, scores NaN and is counted in
``missing_logprobs_total`` (never a guess).

``seed``: each request carries ``seed`` = :func:`pretrain.seeding.seed_for` (seed, iteration, global
sample index) mod 2^31, from the reward's metadata (``iteration``, ``sample_ids``; the batch index and
iteration 0 when absent), so a judge that samples (temperature > 0) scores reproducibly. A
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
SCORINGS = ("text", "yes_prob", "expected_score")


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
            is merged into the JSON body, e.g. vLLM's ``structured_outputs``).
        scoring: ``text`` (parse ``score_pattern``), ``yes_prob`` or ``expected_score`` (from the first
            answer token's log-probs; see the module docstring).
        yes_tokens, no_tokens: the answer tokens of ``yes_prob``; score_tokens: token -> value of
            ``expected_score`` (default "0" ... "10"); top_logprobs: how many log-probs to ask for.
        seed: base of the per-request seeds (None: no seed sent).

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
                 extra_body: dict | None = None, scoring: str = "text", yes_tokens: list[str] | None = None,
                 no_tokens: list[str] | None = None, score_tokens: dict[str, float] | None = None,
                 top_logprobs: int = 20, seed: int | None = None):
        if not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"remote reward: base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("remote reward: need max_concurrency >= 1, max_retries >= 0, timeout_s > 0, "
                             "backoff_s >= 0")
        if scoring not in SCORINGS:
            raise ValueError(f"remote reward: scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
        if top_logprobs < 1:
            raise ValueError(f"remote reward: top_logprobs must be >= 1, got {top_logprobs}")
        self.scoring, self.top_logprobs, self.seed = scoring, int(top_logprobs), seed
        self.yes_tokens = [str(t).strip() for t in (yes_tokens or ["Yes", "yes"])]
        self.no_tokens = [str(t).strip() for t in (no_tokens or ["No", "no"])]
        self.score_tokens = {str(k).strip(): float(v) for k, v in
                             (score_tokens or {str(i): i for i in range(11)}).items()}
        self.pattern = re.compile(score_pattern)
        if score_range is not None and (len(score_range) != 2 or score_range[1] == score_range[0]):
            raise ValueError(f"remote reward: score_range must be [lo, hi] with lo != hi, got {score_range}")
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self.model, self.template, self.score_range = model, prompt_template, score_range
        self.max_concurrency, self.timeout_s = int(max_concurrency), float(timeout_s)
        self.max_retries, self.backoff_s = int(max_retries), float(backoff_s)
        key = api_key or (os.environ.get(api_key_env) if api_key_env else None)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        logprobs = {} if scoring == "text" else {"logprobs": True, "top_logprobs": self.top_logprobs}
        self.body = {"max_tokens": max_tokens, "temperature": temperature, **logprobs, **(extra_body or {})}
        self.system_prompt = system_prompt
        self.unparsed_total = 0
        self.missing_logprobs_total = 0
        self._count_lock = threading.Lock()

    def check(self) -> str | None:
        """Ask the judge about one 8x8 grey image (one request, with the retries) and return its answer
        text, which need not contain a score. ``RewardUnavailable``, one line naming the URL, when the
        server is down or keeps failing, rejects the request (a wrong model name, a missing key) or
        answers without ``choices[0].message``."""
        grey = encode_png_b64(torch.full((1, 3, 8, 8), 0.5))[0]
        try:
            return self._ask((grey, "a grey square", None), None)[1]
        except RuntimeError as e:
            raise RewardUnavailable(one_line(f"remote reward: start-up check failed: {e}")) from e

    def settings(self) -> dict:
        """What decides the judge's answers, for a run's records (``eval.json``): the URL, the model, the
        scoring and the request parameters (temperature, max tokens, log-probs, structured output ...),
        the seed base and the judging text; never the key."""
        tokens = ({"yes_tokens": self.yes_tokens, "no_tokens": self.no_tokens} if self.scoring == "yes_prob" else
                  {"score_tokens": self.score_tokens} if self.scoring == "expected_score" else
                  {"score_pattern": self.pattern.pattern})
        return {"url": self.url, "model": self.model, "scoring": self.scoring, **tokens, "score_range": self.score_range,
                "seed": self.seed, "prompt_template": self.template, "system_prompt": self.system_prompt, **self.body}

    def request(self, png_b64: str, prompt: str, seed: int | None = None) -> dict:
        """The chat-completions JSON body for one image (base64 PNG), its prompt and its seed (None: none
        sent)."""
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}},
                   {"type": "text", "text": self.template.replace("{prompt}", prompt)}]
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {"model": self.model, "messages": messages, **self.body, **({} if seed is None else {"seed": seed})}

    def seeds(self, n: int, metadata: dict | None) -> list[int | None]:
        """The per-request seeds of a batch of ``n`` (see the module docstring); Nones without ``seed``."""
        if self.seed is None:
            return [None] * n
        from pretrain.seeding import seed_for

        meta = metadata or {}
        ids = [int(i) for i in meta["sample_ids"]] if "sample_ids" in meta else list(range(n))
        it = int(meta.get("iteration", 0))
        return [seed_for(self.seed, it, i) % (1 << 31) for i in ids]

    def from_logprobs(self, out: dict) -> float:
        """The ``yes_prob`` / ``expected_score`` of a reply (``choices[0].logprobs.content[0].top_logprobs``),
        mapped by ``score_range``; NaN when the reply has no log-probs or none of the tokens."""
        try:
            top = out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            probs = {}
            for entry in top:
                token = str(entry["token"]).strip()
                probs[token] = probs.get(token, 0.0) + math.exp(float(entry["logprob"]))
        except (KeyError, IndexError, TypeError, ValueError):
            return math.nan
        if self.scoring == "yes_prob":
            yes = sum(probs.get(t, 0.0) for t in self.yes_tokens)
            no = sum(probs.get(t, 0.0) for t in self.no_tokens)
            return yes / (yes + no) if yes + no > 0 else math.nan
        mass = sum(p for t, p in probs.items() if t in self.score_tokens)
        if mass <= 0:
            return math.nan
        value = sum(self.score_tokens[t] * p for t, p in probs.items() if t in self.score_tokens) / mass
        return self._mapped(value)

    def _mapped(self, value: float) -> float:
        if self.score_range is not None:
            lo, hi = self.score_range
            value = min(max((value - lo) / (hi - lo), 0.0), 1.0)
        return value

    def parse(self, answer: str | None) -> float:
        """The score in ``answer`` (mapped by ``score_range``), or NaN when the pattern does not match."""
        m = self.pattern.search(answer) if isinstance(answer, str) else None
        if m is None:
            return math.nan
        try:
            value = float(m.group(1) if self.pattern.groups else m.group(0))
        except ValueError:
            return math.nan
        return self._mapped(value)

    def _ask(self, item, abort) -> tuple[float, str | None]:
        png, prompt, seed = item
        out = post_json(self.url, self.request(png, prompt, seed), timeout_s=self.timeout_s,
                        max_retries=self.max_retries, backoff_s=self.backoff_s, headers=self.headers,
                        abort=abort)
        try:
            answer = out["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"{self.url} answered without choices[0].message: {str(out)[:300]}") from e
        if self.scoring != "text":
            return self.from_logprobs(out), answer
        return self.parse(answer), answer

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        prompts = list(prompts) if prompts is not None else []
        if len(prompts) != images.shape[0]:
            raise ValueError(f"remote reward: {images.shape[0]} images but {len(prompts)} prompts")
        items = list(zip(encode_png_b64(images), prompts, self.seeds(len(prompts), metadata)))
        results = map_ordered(self._ask, items, self.max_concurrency)
        bad = [i for i, (score, _) in enumerate(results) if math.isnan(score)]
        if bad and self.scoring != "text":
            with self._count_lock:
                self.missing_logprobs_total += len(bad)
            log.warning("remote reward: %d/%d replies from %s had no %s log-probs among their top %d (scored "
                        "NaN; %d so far); first, sample %d: %r", len(bad), len(results), self.url, self.scoring,
                        self.top_logprobs, self.missing_logprobs_total, bad[0], str(results[bad[0]][1])[:200])
        elif bad:
            with self._count_lock:
                self.unparsed_total += len(bad)
            log.warning("remote reward: %d/%d answers from %s had no score matching %r (scored NaN; "
                        "%d so far); first, sample %d: %r", len(bad), len(results), self.url,
                        self.pattern.pattern, self.unparsed_total, bad[0], str(results[bad[0]][1])[:200])
        return torch.tensor([score for score, _ in results], dtype=torch.float32)


register("remote")(checked_at_build(RemoteJudge))
