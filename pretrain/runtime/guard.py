"""Numerics guard: a non-finite loss or gradient norm never reaches the weights."""

from __future__ import annotations

import math
from typing import Callable


class RunStopped(RuntimeError):
    """A guard stopped the run on purpose (the CLI prints its one-line reason and exits 1); ``--resume``
    continues from the newest checkpoint (checked again on resume) once the cause is fixed."""


class NonFiniteError(RunStopped):
    """Raised after more than ``max_consecutive`` non-finite steps in a row."""


class NonFiniteGuard:
    """Counts non-finite steps. ``check(step, loss=..., grad_norm=...)`` returns the name of the
    first non-finite quantity (the step must then be skipped) or None; raises ``NonFiniteError``
    once more than ``max_consecutive`` happen in a row. Its message names the step as ``label(step)``
    (e.g. the iteration an optimizer step belongs to), the steps as ``unit`` and ends with ``then()``
    (what a resume would continue from)."""

    def __init__(self, max_consecutive: int, label: Callable[[int], str] = lambda step: f"step {step}",
                 unit: str = "steps", then: Callable[[], str] = lambda: "--resume continues from the newest checkpoint"):
        self.max_consecutive = max_consecutive
        self.label, self.unit, self.then = label, unit, then
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
                f"{self.label(step)}: non-finite {bad} for {self.consecutive} {self.unit} in a row "
                f"(train.max_nonfinite={self.max_consecutive}); stopping. No weights were updated on "
                f"those steps; {self.then()}"
            )
        return bad

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.consecutive = int(state["total"]), int(state["consecutive"])
