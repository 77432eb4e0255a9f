"""Levenshtein edit distance (insertions, deletions, substitutions, each of cost 1)."""

from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    """Edit distance between ``a`` and ``b``: O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]
