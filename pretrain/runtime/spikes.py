"""Loss-spike detection: a value far above its recent history (z-score over a sliding window).

Diffusion losses depend strongly on the noise level (a sigma near 1 gives a much larger flow-matching
loss than one near 0), so a batch that happened to draw high sigmas looks like a spike in the mean. A
trainer therefore passes per-timestep-bucket means (``loss/sigma_0.00-0.25`` ...) next to the overall
loss and gradient norm, and each name is judged against its own history.

``train.spike_window`` (values kept per name; 0 turns detection off), ``train.spike_zscore`` (the
threshold) and ``train.spike_action`` (``warn``: log it; ``skip``: also skip the optimizer step, as
PaLM did for its loss spikes, Chowdhery et al. 2022, Sec. 5.1).
"""

from __future__ import annotations

import math
from collections import deque


def sigma_buckets(sigma, losses, edges=(0.0, 0.25, 0.5, 0.75, 1.0)) -> dict[str, tuple[float, int]]:
    """``{"loss/sigma_a-b": (sum of losses, count)}`` of per-sample ``losses [B]`` float32 by their
    ``sigma [B]`` in [0, 1] (the last bucket includes 1). Sums, so ranks can add them up."""
    out = {}
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        sel = (sigma >= lo) & ((sigma <= hi) if last else (sigma < hi))
        out[f"loss/sigma_{lo:.2f}-{hi:.2f}"] = (float(losses[sel].sum()), int(sel.sum()))
    return out


class SpikeDetector:
    """Flags values more than ``zscore`` standard deviations above the mean of their last ``window``
    values (per name; at least ``min_history`` values are needed before a name is judged). Every finite
    value joins its history, spike or not, so a lasting level change stops being flagged once the window
    holds it. State is checkpointed (``state_dict``) so a resumed run judges as the original would."""

    def __init__(self, window: int = 100, zscore: float = 6.0, min_history: int | None = None):
        self.window, self.zscore = window, zscore
        self.min_history = min_history if min_history is not None else max(5, min(20, window // 2))
        self.history: dict[str, deque] = {}

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def check(self, values: dict[str, float]) -> list[tuple[str, float, float]]:
        """``(name, value, z)`` of each spiking value of ``values`` (non-finite ones are skipped: the
        numerics guard handles them), then adds the finite ones to their history."""
        if not self.enabled:
            return []
        out = []
        for name, v in values.items():
            if not math.isfinite(v):
                continue
            hist = self.history.setdefault(name, deque(maxlen=self.window))
            if len(hist) >= self.min_history:
                mean = sum(hist) / len(hist)
                std = math.sqrt(sum((h - mean) ** 2 for h in hist) / len(hist))
                z = (v - mean) / max(std, 1e-6 * abs(mean), 1e-12)
                if z > self.zscore:
                    out.append((name, v, z))
            hist.append(v)
        return out

    def state_dict(self) -> dict:
        return {name: list(h) for name, h in self.history.items()}

    def load_state_dict(self, state: dict) -> None:
        self.history = {name: deque(map(float, h), maxlen=self.window) for name, h in state.items()}
