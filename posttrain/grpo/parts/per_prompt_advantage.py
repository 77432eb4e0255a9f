"""Advantage estimator ``per_prompt``: DDPO's per-prompt stat tracking (Black et al. 2023, arXiv
2305.13301, sec. 4.3 / app. A, ddpo-pytorch's ``PerPromptStatTracker``).

Every prompt keeps a buffer of its last ``buffer_size`` finite rewards across iterations. A sample's
advantage is (r - mean) / (std + 1e-6) over its prompt's buffer (this iteration's rewards included)
once the buffer holds ``min_count`` rewards; before that, over all of this iteration's finite rewards
(DDPO's fallback). Then clipped to +/- ``clip_max``. NaN rewards are not valid and get 0. The buffers
are part of the checkpoint, so a resumed run continues with the same statistics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from posttrain.objectives.advantages import has_spread, standardize
from posttrain.grpo.parts.registry import ADVANTAGES

EPS = 1e-6


@ADVANTAGES.register("per_prompt")
class PerPromptAdvantage:
    """Per-prompt running reward statistics (DDPO); keyed by the prompt's dataset index (``prompt_ids``)."""

    @dataclass
    class Config:
        """``buffer_size``: rewards kept per prompt (DDPO: 16); ``min_count``: rewards a prompt needs
        before its own statistics are used (DDPO: 16); ``clip_max``: advantages clipped to +/- this
        (DDPO's ``adv_clip_max``, 5)."""

        buffer_size: int = 16
        min_count: int = 16
        clip_max: float = 5.0

        def validate(self, prefix: str = "") -> None:
            if self.buffer_size < 1:
                raise ValueError(f"{prefix}buffer_size: must be >= 1, got {self.buffer_size}")
            if not 1 <= self.min_count <= self.buffer_size:
                raise ValueError(f"{prefix}min_count: must be in [1, buffer_size={self.buffer_size}], "
                                 f"got {self.min_count}")
            if self.clip_max <= 0:
                raise ValueError(f"{prefix}clip_max: must be > 0, got {self.clip_max}")

    def __init__(self, cfg: "PerPromptAdvantage.Config"):
        self.cfg = cfg
        self.buffers: dict[int, list[float]] = {}

    def __call__(self, total: torch.Tensor, raw: dict, weights: dict, group_ids: torch.Tensor,
                 prompt_ids: torch.Tensor):
        """``total`` float ``[N]`` (NaN allowed), ``prompt_ids`` long ``[N]``: (advantages float32 ``[N]``,
        valid bool ``[N]``, zero_spread bool ``[N]`` = the statistics used have no spread beyond rounding:
        :func:`posttrain.objectives.advantages.has_spread`)."""
        r = total.double()  # statistics in float64 (posttrain.objectives.advantages.standardize)
        valid = torch.isfinite(r)
        adv, zero = torch.zeros_like(r), ~valid
        batch = r[valid]
        for p in torch.unique(prompt_ids[valid]).tolist():
            m = valid & (prompt_ids == p)
            buf = (self.buffers.get(p, []) + r[m].tolist())[-self.cfg.buffer_size:]
            self.buffers[p] = buf
            ref = torch.tensor(buf, dtype=torch.float64) if len(buf) >= self.cfg.min_count else batch
            if not has_spread(ref):
                zero |= m
                continue
            adv[m] = standardize(r[m], ref, EPS)
        return adv.clamp(-self.cfg.clip_max, self.cfg.clip_max).float(), valid, zero

    def state_dict(self) -> dict:
        """The buffers, as one JSON string (checkpoints store it whole)."""
        return {"buffers": json.dumps({str(k): v for k, v in self.buffers.items()})}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {int(k): [float(x) for x in v] for k, v in json.loads(state["buffers"]).items()}
