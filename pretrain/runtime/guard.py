"""Numerics guard: a non-finite loss or gradient norm never reaches the weights."""

from __future__ import annotations

import math


class RunStopped(RuntimeError):
    """A guard stopped the run on purpose (the CLI prints its one-line reason and exits 1); the last
    complete checkpoint is intact and ``--resume`` continues from it once the cause is fixed."""


class NonFiniteError(RunStopped):
    """Raised after more than ``max_consecutive`` non-finite steps in a row."""


class NonFiniteGuard:
    """Counts non-finite steps. ``check(step, loss=..., grad_norm=...)`` returns the name of the
    first non-finite quantity (the step must then be skipped) or None; raises ``NonFiniteError``
    once more than ``max_consecutive`` happen in a row."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0

    def check(self, step: int, **quantities: float) -> str | None:
        bad = next((k for k, v in quantities.items() if not math.isfinite(v)), None)
        if bad is None:
            self.consecutive = 0
            return None
        self.total += 1
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise NonFiniteError(
                f"step {step}: non-finite {bad} for {self.consecutive} steps in a row "
                f"(train.max_nonfinite={self.max_consecutive}); stopping. No weights were updated on "
                f"those steps; the last complete checkpoint is intact."
            )
        return bad

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.consecutive = int(state["total"]), int(state["consecutive"])
