"""Learning-signal guard: a post-training run whose rewards score nothing stops instead of training on
zeros.

Two conditions, both checked on an iteration's gathered rewards *before* its update (so the stopping
iteration changes no weight and the last complete checkpoint is the run's state):

- no sample has a finite total reward (every reward returned NaN / inf, or a reward server answered
  nothing usable): stop at once;
- every prompt group has zero spread (all advantages 0) for ``max_no_signal`` iterations in a row:
  stop. A single such iteration is normal (a sparse reward early on), a streak is not.

Non-finite rewards are "not applicable" (:mod:`posttrain.objectives.advantages`); they are counted per reward in the
metrics (``reward/<name>_nonfinite``), and a reward that is non-finite for every sample of an iteration
is named in the log.
"""

from __future__ import annotations

import torch

from pretrain.runtime.guard import RunStopped


class NoSignalError(RunStopped):
    """The rewards carry no learning signal (see the module docstring); the message names the iteration,
    the rewards and the counts."""


def nonfinite_counts(raw: dict[str, torch.Tensor]) -> dict[str, int]:
    """``{name: number of non-finite values}`` of ``{name: float [B]}`` raw rewards."""
    return {name: int((~torch.isfinite(r.float())).sum()) for name, r in raw.items()}


class SignalGuard:
    """Checks each iteration's rewards; ``max_no_signal``: zero-spread iterations in a row tolerated
    before the run stops (0: never stop on zero spread). Checkpointed with the run (its streak), so a
    resumed run stops where the uninterrupted one would."""

    def __init__(self, max_no_signal: int):
        self.max_no_signal = max_no_signal
        self.streak = 0

    def check(self, iteration: int, total: torch.Tensor, raw: dict[str, torch.Tensor],
              zero_spread: torch.Tensor) -> list[str]:
        """``iteration``: 1-based number of the iteration checked; ``total`` float ``[N]`` weighted sum
        (NaN where no reward applies), ``raw`` ``{name: float [N]}``, ``zero_spread`` bool ``[N]``.

        Returns log lines (rewards that scored nothing this iteration); raises :class:`NoSignalError`
        when no sample has a finite reward, or on the ``max_no_signal``-th zero-spread iteration in a row."""
        n = total.numel()
        counts = nonfinite_counts(raw)
        scored = ", ".join(f"{name}: {c} of {n} non-finite" for name, c in counts.items())
        if not bool(torch.isfinite(total.float()).any()):
            raise NoSignalError(f"iteration {iteration}: no sample has a finite reward ({scored}); stopping before "
                                f"the update. The last complete checkpoint is intact.")
        lines = [f"iteration {iteration}: reward {name} is non-finite for all {n} samples (not applicable: the "
                 f"other rewards carry the signal)" for name, c in counts.items() if c == n]
        if bool(zero_spread.all()):
            self.streak += 1
            if self.max_no_signal and self.streak >= self.max_no_signal:
                raise NoSignalError(
                    f"iteration {iteration}: every group has had zero reward spread for {self.streak} iterations "
                    f"in a row (train.max_no_signal={self.max_no_signal}): all advantages are 0; stopping before "
                    f"the update. The last complete checkpoint is intact.")
            lines.append(f"iteration {iteration}: every group has zero reward spread: no learning signal "
                         f"({self.streak} in a row; the run stops at train.max_no_signal={self.max_no_signal})")
        else:
            self.streak = 0
        return lines

    def state_dict(self) -> dict:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.streak = int(state["streak"])
