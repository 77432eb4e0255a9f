"""SDE windows: the stochastic step (and training) only inside a window of transitions, the
deterministic ODE step elsewhere, so only the window's transitions carry log-probs and are trained.

Three ways the window moves (``mode``):

- ``fixed``: transitions [start, start + size);
- ``random``: each iteration a size in [min_size, size] and a position inside [start, end), drawn from
  (seed, "window", iteration) (Flow-GRPO-Fast: 1-3 SDE steps within the first half of the schedule);
- ``progressive``: [start, start + size) moved by ``stride`` every ``every`` iterations, wrapping
  around inside [start, end) (MixGRPO, Li et al. 2025, arXiv 2507.21802: window 4 of 25, moved every
  25 iterations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.seeding import generator_for


@dataclass
class WindowConfig:
    """``rollout.sde_window``. ``size`` 0 = no window (every transition stochastic, plain Flow-GRPO).
    ``end`` None = the last transition. ``min_size`` (random mode) None = ``size``."""

    size: int = 0
    mode: str = "fixed"
    start: int = 0
    end: int | None = None
    min_size: int | None = None
    every: int = 1
    stride: int = 1

    def check(self, num_steps: int, prefix: str = "") -> None:
        """``ValueError`` naming the key when the window does not fit ``num_steps`` transitions."""
        if self.size == 0:
            return
        if self.mode not in ("fixed", "random", "progressive"):
            raise ValueError(f"{prefix}mode: '{self.mode}' is not one of fixed, random, progressive")
        end = num_steps if self.end is None else self.end
        if self.size < 0 or self.start < 0 or not self.start + self.size <= end <= num_steps:
            raise ValueError(f"{prefix}size: a window of {self.size} from start {self.start} must fit in "
                             f"[start, end={end}] within the {num_steps} transitions")
        if self.min_size is not None and not 1 <= self.min_size <= self.size:
            raise ValueError(f"{prefix}min_size: must be in [1, size={self.size}], got {self.min_size}")
        if self.every < 1 or self.stride < 1:
            raise ValueError(f"{prefix}every: every and stride must be >= 1")

    def bounds(self, num_steps: int, seed: int, iteration: int) -> tuple[int, int] | None:
        """The window [lo, hi) of ``iteration`` (0-based), or None without a window."""
        if self.size == 0:
            return None
        end = num_steps if self.end is None else self.end
        if self.mode == "fixed":
            return self.start, self.start + self.size
        if self.mode == "random":
            g = generator_for(seed, "window", iteration)
            size = int(torch.randint(self.min_size or self.size, self.size + 1, (1,), generator=g))
            lo = int(torch.randint(self.start, end - size + 1, (1,), generator=g))
            return lo, lo + size
        positions = end - self.start - self.size + 1
        lo = self.start + (iteration // self.every * self.stride) % positions
        return lo, lo + self.size
