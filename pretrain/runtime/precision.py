"""Mixed precision: fp32, bf16 autocast, fp16 autocast with a gradient scaler.

Losses, log-probs and rewards are computed in float32 by the callers (they upcast model outputs).
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """``autocast()`` context and an optional ``GradScaler`` (fp16 only). ``ValueError`` if unknown."""

    def __init__(self, name: str, device: torch.device):
        if name not in DTYPES:
            raise ValueError(f"train.precision: unknown precision '{name}' (known: {sorted(DTYPES)})")
        self.name, self.dtype, self.device = name, DTYPES[name], device
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)
