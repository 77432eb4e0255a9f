"""Counting prompts longer than a text model's token limit.

Every tokenizer here cuts a prompt at a fixed number of tokens (CLIP: 77, ImageReward's BERT: 35,
MiniLM: 24 or 32), so two prompts that agree up to the limit get the same embedding and the same
score. A :class:`TruncationCounter` per model records, per call, how many prompts were longer than
the limit, and logs one warning per process and name (``logging``, logger ``pretrain.truncation``)
naming the model, the limit and an example prompt. Lengths count the tokenizer's special tokens
([CLS]/[SEP], start/end of text): a prompt of ``limit`` tokens including them is not truncated.

A leaf utility of ``pretrain`` (it imports nothing of the project): the policy's text encoders
(``pretrain.text_encoder``) and the rewards share it. The rule the code keeps: ``rewards`` may import
``pretrain``'s leaf utilities; ``pretrain`` imports no reward.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

_WARNED: set[str] = set()  # names already warned about in this process
_WARNED_LOCK = threading.Lock()
EXAMPLE_CHARS = 80


def shorten(text: str, width: int = EXAMPLE_CHARS) -> str:
    """``text`` cut to at most ``width`` characters, ``...`` marking a cut."""
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


def hf_token_counts(tokenizer, prompts: Sequence[str]) -> list[int]:
    """Tokens per prompt (special tokens included, nothing cut) of a transformers tokenizer: ``B``
    prompts -> ``B`` ints. Tokenizes only (no model); the tokenizer's own too-long warning is off."""
    if not prompts:
        return []
    ids = tokenizer(list(prompts), add_special_tokens=True, truncation=False, padding=False,
                    verbose=False)["input_ids"]
    return [len(i) for i in ids]


def openclip_token_counts(tokenizer, prompts: Sequence[str]) -> list[int] | None:
    """Tokens per prompt (start and end of text included) of an OpenCLIP tokenizer: its BPE
    ``SimpleTokenizer`` (``encode`` + 2) or its ``HFTokenizer`` wrapper (the wrapped transformers
    tokenizer after the wrapper's text cleaning). None for another kind (nothing is counted)."""
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "sot_token_id"):
        return [len(tokenizer.encode(p)) + 2 for p in prompts]
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and callable(getattr(tokenizer, "clean_fn", None)):
        return hf_token_counts(inner, [tokenizer.clean_fn(p) for p in prompts])
    return None


class TruncationCounter:
    """Prompts longer than ``limit`` tokens seen by the model called ``name`` (a reward's registered
    name, or ``text_encoder.<name>``).

    ``last_fraction``: the share of the last call's prompts that were cut (NaN before any call or
    after a call without prompts). ``total_truncated`` / ``total``: counts since construction.
    :meth:`take` returns the counts since its previous call (a training iteration scores several
    batches, possibly on worker threads). Thread-safe."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit = str(name), int(limit)
        self.last_truncated = self.last_total = 0
        self.total_truncated = self.total = 0
        self._window = [0, 0]
        self._lock = threading.Lock()

    def record(self, n_truncated: int, n: int, example: str | None = None, length: int | None = None) -> None:
        """Record one call: ``n_truncated`` of ``n`` prompts were longer than the limit; with
        ``example`` (one such prompt, ``length`` its tokens) the first record of this name in the
        process logs a warning. ``ValueError`` unless 0 <= ``n_truncated`` <= ``n``."""
        n_truncated, n = int(n_truncated), int(n)
        if not 0 <= n_truncated <= n:
            raise ValueError(f"{self.name}: truncated count {n_truncated} not in [0, {n}]")
        with self._lock:
            self.last_truncated, self.last_total = n_truncated, n
            self.total_truncated += n_truncated
            self.total += n
            self._window[0] += n_truncated
            self._window[1] += n
        if n_truncated and example is not None:
            self._warn_once(n_truncated, n, example, length)

    def check(self, prompts: Sequence[str], lengths: Sequence[int] | None) -> float:
        """Record a call on ``prompts`` whose token counts are ``lengths`` (special tokens included;
        None: not countable, nothing recorded). Returns the fraction longer than the limit (NaN for
        no prompts or no lengths). ``ValueError`` when ``lengths`` and ``prompts`` differ in length."""
        if lengths is None:
            return float("nan")
        if len(lengths) != len(prompts):
            raise ValueError(f"{self.name}: {len(lengths)} token counts for {len(prompts)} prompts")
        long = [i for i, k in enumerate(lengths) if k > self.limit]
        first = long[0] if long else None
        self.record(len(long), len(prompts), None if first is None else prompts[first],
                    None if first is None else lengths[first])
        return len(long) / len(prompts) if prompts else float("nan")

    @property
    def last_fraction(self) -> float:
        """Share of the last call's prompts longer than the limit, in [0, 1]; NaN when none."""
        with self._lock:
            return self.last_truncated / self.last_total if self.last_total else float("nan")

    def take(self) -> tuple[int, int]:
        """(prompts truncated, prompts seen) since the previous ``take``; resets that window."""
        with self._lock:
            out = (self._window[0], self._window[1])
            self._window = [0, 0]
        return out

    def _warn_once(self, n_truncated: int, n: int, example: str, length: int | None) -> None:
        with _WARNED_LOCK:
            if self.name in _WARNED:
                return
            _WARNED.add(self.name)
        tokens = f", {length} tokens" if length is not None else ""
        log.warning("%s truncates prompts at %d tokens: %d of %d prompts in this call are longer and are cut, "
                    "so prompts that agree up to the limit are treated alike (e.g. %r%s). Warned once per "
                    "process.", self.name, self.limit, n_truncated, n, shorten(example), tokens)


def truncation_counters(model: Any) -> list[TruncationCounter]:
    """The counters of ``model`` and of the rewards it wraps: its ``truncation`` attribute, the
    ``members`` of ``ensemble`` (``(name, reward)`` pairs) and the ``reward`` of ``per_frame``;
    each counter once."""
    found: list[TruncationCounter] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        counter = getattr(obj, "truncation", None)
        if isinstance(counter, TruncationCounter) and all(c is not counter for c in found):
            found.append(counter)
        for member in getattr(obj, "members", None) or ():
            walk(member[1] if isinstance(member, tuple) else member)
        walk(getattr(obj, "reward", None))

    walk(model)
    return found


def take_truncation_counts(models: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``{name: (prompts truncated, prompts seen)}`` since the previous call, summed over the counters
    of each reward in ``models`` (e.g. ``CompositeReward.models``); rewards without a counter are
    left out. Counts, so ranks can be summed before dividing."""
    out = {}
    for name, model in models.items():
        counters = truncation_counters(model)
        if counters:
            taken = [c.take() for c in counters]
            out[name] = (sum(k for k, _ in taken), sum(n for _, n in taken))
    return out


def fractions(counts: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """``{name: truncated / seen}`` of :func:`take_truncation_counts`' counts; NaN where nothing was seen."""
    return {name: (k / n if n else math.nan) for name, (k, n) in counts.items()}

