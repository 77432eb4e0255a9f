"""Fault injection, to test what a run does when a rank dies or computes a NaN (torchft and torchtitan
test their recovery the same way). Off unless the environment variable ``POSTTRAIN_FAULT`` is set.

``POSTTRAIN_FAULT="<kind>:rank=<r>,step=<k>[,restart=<n>][;<kind>:...]"``, each entry firing on global
rank ``r`` at optimizer step ``k`` (the runtime's step count, 1-based) during torchrun attempt ``n``
(``TORCHELASTIC_RESTART_COUNT``, default 0, so a restarted job does not die again at the same step):

- ``exit``: ``os._exit(43)`` before the step is applied: the rank disappears without a Python error,
  as after a kill, a segfault or the OOM killer.
- ``node``: the rank's torchrun agent (its parent process) is killed, then the rank exits as with
  ``exit``: the node is lost for good, so an elastic job (``--nnodes MIN:MAX``) goes on without it.
- ``nan_loss``: this rank's loss value for the step becomes NaN (its gradients are unchanged).
- ``nan_grad``: this rank's local gradient of its first trainable parameter becomes NaN.

Raises ``ValueError`` naming the variable for an entry it cannot read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "POSTTRAIN_FAULT"
KINDS = ("exit", "node", "nan_loss", "nan_grad")
EXIT_CODE = 43


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    restart: int = 0


def parse(text: str) -> list[Fault]:
    """The faults of a ``POSTTRAIN_FAULT`` value (see the module docstring)."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        kind, _, rest = entry.partition(":")
        try:
            fields = {k.strip(): int(v) for k, v in (f.split("=") for f in rest.split(",") if f.strip())}
        except ValueError as e:
            raise ValueError(f"{ENV}: cannot read '{entry}' (expected kind:rank=R,step=K[,restart=N])") from e
        if kind not in KINDS or not {"rank", "step"} <= set(fields) or set(fields) - {"rank", "step", "restart"}:
            raise ValueError(f"{ENV}: cannot read '{entry}': kind is one of {', '.join(KINDS)}; fields rank, step "
                             f"and optionally restart")
        out.append(Fault(kind, **fields))
    return out


def active(step: int) -> set[str]:
    """The kinds of fault that fire on this process at optimizer ``step`` (empty when none is set)."""
    text = os.environ.get(ENV, "")
    if not text:
        return set()
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return {f.kind for f in parse(text) if (f.rank, f.step, f.restart) == (rank, step, restart)}


def inject(step: int, loss_value: float, params: list) -> float:
    """Apply the faults due at ``step`` to this rank (``params``: its trainable parameters, gradients
    already computed); returns the loss value to use. Never returns when ``exit`` fires."""
    kinds = active(step)
    if "node" in kinds:
        import signal

        os.kill(os.getppid(), signal.SIGKILL)
    if kinds & {"exit", "node"}:
        os._exit(EXIT_CODE)
    if "nan_grad" in kinds:
        grad = next(p.grad for p in params if p.grad is not None)
        (grad._local_tensor if hasattr(grad, "_local_tensor") else grad).fill_(float("nan"))
    return float("nan") if "nan_loss" in kinds else loss_value
