"""A codec wrapper that times decoding (the rollout reports decode time apart from sampling)."""

from __future__ import annotations

import time

import torch


class TimedCodec:
    """A codec whose ``decode`` time (seconds) accumulates in ``seconds``."""

    def __init__(self, codec):
        self.codec, self.seconds = codec, 0.0

    def __getattr__(self, name: str):
        return getattr(self.__dict__["codec"], name)  # the wrapped codec's other methods and attributes

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.codec.decode(latents)
        self.seconds += time.perf_counter() - t0
        return out
