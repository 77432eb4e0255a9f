"""``ensemble``: the mean of several reward models' scores (e.g. one learned reward trained with K seeds).

A policy optimised against one learned reward model finds what that model alone likes; the errors of
independently trained members are partly independent, so their mean is harder to exploit (reward-model
ensembles against over-optimisation: Coste et al. 2023, arXiv 2310.02743, the "mean" objective).
"""

from __future__ import annotations

import torch

from rewards.base import build_reward, register


@register("ensemble")
class Ensemble:
    """NaN-aware mean over ``members`` of their scores, float32 ``[B]`` (NaN only where every member is
    NaN). ``members``: a list of ``{name: <registered name or pkg.module:attr>, <parameters>}``, e.g.
    ``[{name: learned_clip_contrastive, path: runs/reward/a0/model}, {name: ..., path: .../a1/model}]``.
    Input as the members take it. ``ValueError`` for an empty list, a member without ``name`` or a
    member returning another shape."""

    name = "ensemble"

    def __init__(self, members: list):
        if not members:
            raise ValueError("ensemble.members: give at least one {name: ..., <parameters>} entry")
        self.members = []
        for i, spec in enumerate(members):
            params = dict(spec)
            name = params.pop("name", None)
            if not name:
                raise ValueError(f"ensemble.members.{i}: missing 'name' (a reward name or pkg.module:attr)")
            self.members.append((str(name), build_reward(str(name), **params)))

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        b = images.shape[0]
        scores = []
        for name, reward in self.members:
            s = torch.as_tensor(reward(images, prompts, metadata), dtype=torch.float32).cpu()
            if s.shape != (b,):
                raise ValueError(f"ensemble: member '{name}' returned shape {tuple(s.shape)} for {b} samples")
            scores.append(s)
        return torch.stack(scores).nanmean(dim=0)

