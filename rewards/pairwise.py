"""``pairwise_remote``: a VLM judge that compares the images of one prompt group instead of scoring each
alone, and the win-rate reward made of its answers (Pref-GRPO: Wang et al. 2025, arXiv 2508.20751,
sec. 3.2: the images of a group are compared pairwise and each image's win rate is its reward, so a
trivial score difference cannot be blown up by the group normalisation).

The server is the same OpenAI-compatible chat-completions endpoint as ``remote``
(:class:`rewards.remote.RemoteJudge`: retries, key, ``extra_body``, per-request seeds, log-prob reading
are shared). Two protocols:

- ``pairs``: one request per unordered pair (i, j) of a group, the two images then the judging text. The
  answer gives p = P(the first image is better): ``scoring: text`` reads ``answer_pattern``'s first group
  (``1`` -> 1, ``2`` -> 0, ``tie`` -> 0.5); ``scoring: yes_prob`` reads the first answer token's
  log-probs, p = P(``first_tokens``) / (P(``first_tokens``) + P(``second_tokens``)) among the top ones
  (a tie is p = 0.5). Sample i's win rate is ``sum_j p(i beats j) / (number of its comparisons)``, in
  [0, 1]; a group of G asks G(G-1)/2 questions.
- ``ranking``: one request per group with all its images; the answer lists the image numbers best first
  (``scoring: text`` only). The image shown at rank r (0 = best) of a group of G gets (G - 1 - r) / (G - 1),
  the win rate it would have had if every pair had been asked and answered consistently with the
  ranking.

**Position bias** (judges prefer the first image) is randomised, not removed: each pair is shown once, as
(i, j) or (j, i), and each group's images in a shuffled order, so a preference for a position becomes
noise spread evenly over the samples rather than a bias toward some of them. The orders are drawn from
:func:`pretrain.seeding.seed_for` (``order_seed``, iteration, the samples' global indices), so the same
run shows the same orders and a resumed run asks the same questions.

**Groups** come from the metadata's ``group_ids`` (GRPO passes each rollout batch's prompt groups;
``rollout.batch_size`` must hold whole groups, checked when the config loads), else from equal prompt
texts. A group of one, an unreadable answer and a sample with no readable comparison are not guessed:
an unreadable answer is dropped and counted (``unparsed_total``), a sample alone in its group is
counted (``ungrouped_total``), and a sample left with no readable comparison scores NaN; one warning
per batch.

**What a win rate cannot show**: every comparison hands out one point, so the win rates of a whole
group always average 0.5. They rank samples within a group (what GRPO's group advantage uses), but a
mean over samples, iterations or models is 0.5 by construction: judge progress, in ``posttrain eval``
or the guard, with a pointwise reward.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re

import torch

from pretrain.seeding import seed_for
from rewards.base import register
from rewards.png import encode_png_b64
from rewards.remote import RemoteJudge
from rewards.transport import RewardUnavailable, checked_at_build, map_ordered, one_line, post_json

log = logging.getLogger(__name__)

PAIR_TEMPLATE = ('Which of the two images matches the description "{prompt}" better? Answer only with 1 (the first '
                 'image), 2 (the second image) or tie.')
RANKING_TEMPLATE = ('Rank these {n} images by how well each matches the description "{prompt}", best first. Answer '
                    'only with the image numbers 1 to {n} separated by spaces.')
PAIR_PATTERN = r"(?i)\b(1|2|tie)\b"
CHOICES = {"1": 1.0, "2": 0.0, "tie": 0.5}
PROTOCOLS = ("pairs", "ranking")


def win_rates_from_pairs(n: int, comparisons: list[tuple[int, int, float]]) -> torch.Tensor:
    """Per-sample win rates from pairwise outcomes: ``comparisons`` holds (first, second, p) with p =
    P(first beats second) in [0, 1] (0.5 a tie; NaN: no answer, dropped). Returns float32 ``[n]``:
    sum of each sample's p over its answered comparisons / their count; NaN for a sample with none."""
    wins, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for a, b, p in comparisons:
        if math.isnan(p):
            continue
        wins[a] += p
        wins[b] += 1.0 - p
        count[a] += 1
        count[b] += 1
    return torch.where(count > 0, wins / count.clamp(min=1), torch.full_like(wins, math.nan)).float()


def win_rates_from_ranking(shown: list[int], ranking: list[int] | None, n: int) -> torch.Tensor:
    """``shown``: the sample index of each displayed image (display order); ``ranking``: display positions
    best first (0-based), or None (unreadable). Returns float32 ``[n]``: (G - 1 - rank) / (G - 1) for the
    shown samples, NaN elsewhere and for all of them when ``ranking`` is None."""
    out = torch.full((n,), math.nan)
    if ranking is None:
        return out
    g = len(shown)
    for rank, position in enumerate(ranking):
        out[shown[position]] = (g - 1 - rank) / (g - 1)
    return out


class PairwiseJudge(RemoteJudge):
    """Reward = each sample's win rate within its prompt group, from a chat-completions judge that compares
    images (see the module docstring for the protocols, the order randomisation and the groups).

    Args (besides :class:`rewards.remote.RemoteJudge`'s ``base_url``, ``model``, ``max_concurrency``,
    ``timeout_s``, ``max_retries``, ``backoff_s``, ``api_key(_env)``, ``temperature``, ``system_prompt``,
    ``extra_body``, ``top_logprobs``, ``seed``):
        protocol: ``pairs`` or ``ranking``.
        prompt_template: judging text; ``{prompt}`` (and ``{n}`` for ranking) replaced.
        answer_pattern: regex whose first group is ``1``, ``2`` or ``tie`` (pairs, text scoring).
        scoring: ``text`` or ``yes_prob`` (pairs: P(first) from log-probs).
        first_tokens, second_tokens: the answer tokens meaning "the first / second image" (yes_prob).
        order_seed: seed of the displayed orders.
        max_tokens: answer length (a ranking of G needs about 2G tokens).

    ``__call__(images [B, 3, H, W] float32 in [0, 1], prompts list[str] of length B, metadata)`` -> float32
    ``[B]`` win rates in [0, 1] (NaN: no readable comparison). ``ValueError`` for bad arguments or a
    prompt count that differs from the images'; ``RuntimeError`` naming the URL when the server cannot
    be reached or keeps failing.
    """

    #: rewards whose value depends on the other samples of a prompt group (a rollout batch must hold whole groups)
    groupwise = True

    def __init__(self, base_url: str, model: str, protocol: str = "pairs", prompt_template: str | None = None,
                 answer_pattern: str = PAIR_PATTERN, scoring: str = "text", first_tokens: list[str] | None = None,
                 second_tokens: list[str] | None = None, order_seed: int = 0, max_tokens: int = 16,
                 max_concurrency: int = 8, timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 api_key: str | None = None, api_key_env: str | None = None, temperature: float = 0.0,
                 system_prompt: str | None = None, extra_body: dict | None = None, top_logprobs: int = 20,
                 seed: int | None = None):
        if protocol not in PROTOCOLS:
            raise ValueError(f"pairwise_remote: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if scoring not in ("text", "yes_prob") or (protocol == "ranking" and scoring != "text"):
            raise ValueError(f"pairwise_remote: scoring must be text or yes_prob (pairs), text (ranking); got "
                             f"{scoring!r} with protocol {protocol!r}")
        template = prompt_template or (PAIR_TEMPLATE if protocol == "pairs" else RANKING_TEMPLATE)
        super().__init__(base_url, model, prompt_template=template, score_pattern=answer_pattern, scoring=scoring,
                         yes_tokens=first_tokens or ["1"], no_tokens=second_tokens or ["2"],
                         max_tokens=max_tokens, max_concurrency=max_concurrency, timeout_s=timeout_s,
                         max_retries=max_retries, backoff_s=backoff_s, api_key=api_key, api_key_env=api_key_env,
                         temperature=temperature, system_prompt=system_prompt, extra_body=extra_body,
                         top_logprobs=top_logprobs, seed=seed)
        self.protocol, self.order_seed = protocol, int(order_seed)
        self.ungrouped_total = 0

    def check(self) -> str | None:
        """Ask one comparison of two 8x8 grey images (``RewardUnavailable`` naming the URL on failure)."""
        grey = encode_png_b64(torch.full((1, 3, 8, 8), 0.5))[0]
        try:
            return self._compare(([grey, grey], "a grey square", None), None)[1]
        except RuntimeError as e:
            raise RewardUnavailable(one_line(f"pairwise_remote: start-up check failed: {e}")) from e

    def request_images(self, pngs: list[str], prompt: str, seed: int | None = None) -> dict:
        """The chat-completions body: every image (base64 PNG) in the order given, then the judging text."""
        text = self.template.replace("{prompt}", prompt).replace("{n}", str(len(pngs)))
        body = dict(self.body)
        if self.protocol == "ranking":  # "1 2 ... n": room for every number and its separator
            body["max_tokens"] = max(int(body["max_tokens"]), 3 * len(pngs) + 4)
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{p}"}} for p in pngs]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {"model": self.model, "messages": messages, **body, **({} if seed is None else {"seed": seed})}

    def settings(self) -> dict:
        """:meth:`rewards.remote.RemoteJudge.settings` plus the protocol, the order seed and the answer tokens."""
        return {**super().settings(), "protocol": self.protocol, "order_seed": self.order_seed,
                "first_tokens": self.yes_tokens, "second_tokens": self.no_tokens}

    def parse_choice(self, answer: str | None) -> float:
        """P(first image better) from an answer's text: 1, 0 or 0.5 (tie); NaN when nothing matches."""
        m = self.pattern.search(answer) if isinstance(answer, str) else None
        found = (m.group(1) if self.pattern.groups else m.group(0)) if m else None
        return CHOICES.get(found.lower(), math.nan) if found else math.nan

    @staticmethod
    def parse_ranking(answer: str | None, n: int) -> list[int] | None:
        """Display positions (0-based) best first from an answer listing 1..n once each; None otherwise."""
        numbers = [int(x) for x in re.findall(r"\d+", answer)] if isinstance(answer, str) else []
        return [x - 1 for x in numbers[:n]] if sorted(numbers[:n]) == list(range(1, n + 1)) else None

    def _compare(self, item, abort):
        pngs, prompt, seed = item
        out = post_json(self.url, self.request_images(pngs, prompt, seed), timeout_s=self.timeout_s,
                        max_retries=self.max_retries, backoff_s=self.backoff_s, headers=self.headers, abort=abort)
        try:
            answer = out["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"{self.url} answered without choices[0].message: {str(out)[:300]}") from e
        if self.protocol == "ranking":
            return self.parse_ranking(answer, len(pngs)), answer
        return (self.from_logprobs(out) if self.scoring != "text" else self.parse_choice(answer)), answer

    def groups(self, prompts: list[str], metadata: dict | None) -> list[list[int]]:
        """The batch's prompt groups as lists of sample positions (metadata ``group_ids``, else equal prompts)."""
        keys = metadata.get("group_ids") if metadata else None
        keys = [int(k) for k in keys] if keys is not None else list(prompts)
        out: dict = {}
        for i, k in enumerate(keys):
            out.setdefault(k, []).append(i)
        return list(out.values())

    def _seed(self, iteration: int, ids: list[int]) -> int | None:
        return None if self.seed is None else seed_for(self.seed, iteration, *ids) % (1 << 31)

    def questions(self, pngs: list[str], prompts: list[str], metadata: dict | None):
        """The batch's requests and what each covers: (items for :meth:`_compare`, shown sample positions per
        item, positions in groups of one). Orders and seeds are drawn as the module docstring says."""
        meta = metadata or {}
        for key in ("sample_ids", "group_ids"):
            if meta.get(key) is not None and len(meta[key]) != len(prompts):
                raise ValueError(f"pairwise_remote: metadata {key} has {len(meta[key])} entries for "
                                 f"{len(prompts)} samples")
        ids = [int(i) for i in meta["sample_ids"]] if "sample_ids" in meta else list(range(len(prompts)))
        it = int(meta.get("iteration", 0))
        items, shown, alone = [], [], []
        for members in self.groups(prompts, metadata):
            if len(members) < 2:
                alone += members
                continue
            if self.protocol == "ranking":
                order = list(members)
                random.Random(seed_for(self.order_seed, it, *[ids[m] for m in members])).shuffle(order)
                picks = [order]
            else:
                picks = []
                for a, b in itertools.combinations(members, 2):
                    swap = seed_for(self.order_seed, it, ids[a], ids[b]) & 1
                    picks.append([b, a] if swap else [a, b])
            for pick in picks:
                items.append(([pngs[k] for k in pick], prompts[pick[0]], self._seed(it, [ids[k] for k in pick])))
                shown.append(pick)
        return items, shown, alone

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        prompts = list(prompts) if prompts is not None else []
        n = images.shape[0]
        if len(prompts) != n:
            raise ValueError(f"pairwise_remote: {n} images but {len(prompts)} prompts")
        items, shown, alone = self.questions(encode_png_b64(images), prompts, metadata)
        results = map_ordered(self._compare, items, self.max_concurrency)
        if self.protocol == "ranking":
            rates = torch.full((n,), math.nan)
            for pick, (ranking, _) in zip(shown, results):
                part = win_rates_from_ranking(pick, ranking, n)
                rates = torch.where(part.isnan(), rates, part)
            bad = [i for i, (ranking, _) in enumerate(results) if ranking is None]
        else:
            rates = win_rates_from_pairs(n, [(pick[0], pick[1], p) for pick, (p, _) in zip(shown, results)])
            bad = [i for i, (p, _) in enumerate(results) if math.isnan(p)]
        with self._count_lock:
            self.unparsed_total += len(bad)
            self.ungrouped_total += len(alone)
        if bad:
            log.warning("pairwise_remote: %d/%d answers from %s could not be read (dropped; %d so far); first: %r",
                        len(bad), len(results), self.url, self.unparsed_total, str(results[bad[0]][1])[:200])
        if alone:
            log.warning("pairwise_remote: %d sample(s) without another of their prompt group in the batch scored "
                        "NaN (%d so far)", len(alone), self.ungrouped_total)
        return rates


register("pairwise_remote")(checked_at_build(PairwiseJudge))
