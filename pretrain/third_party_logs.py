"""Filters for two start-up warnings that torchao 0.18 (the ``lowp`` extra) makes its neighbours print in
every process, whether or not low precision is used: torch's ``_pytree`` notes that torchao registers
Enum constants it no longer needs to, and diffusers 0.42's torchao quantizer looks for classes torchao
0.18 moved (it only matters for loading checkpoints saved as torchao tensors, which this project does
not do). Installed when :mod:`pretrain` is imported; every other message of those loggers passes."""

from __future__ import annotations

import logging

_DROPPED = {
    "torch.utils._pytree": "is an Enum subclass and is now natively supported by torch.compile",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def install() -> None:
    """Add the filters to their loggers (idempotent)."""
    for name, text in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(text))
