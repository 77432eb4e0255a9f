"""``ensemble``: the mean of several reward models' scores (e.g. one learned reward trained with K seeds).

A policy optimised against one learned reward model finds what that model alone likes; the errors of
independently trained members are partly independent, so their mean is harder to exploit (reward-model
ensembles against over-optimisation: Coste et al. 2023, arXiv 2310.02743, the "mean" objective).
"""

from __future__ import annotations

import torch

from rewards.base import build_from_spec, check_reward_weights, register
from rewards.specs import RewardSpec


@register("ensemble")
class Ensemble:
    """NaN-aware mean over ``members`` of their scores, float32 ``[B]`` (NaN only where every member is
    NaN). ``members``: a list of ``{name: <registered name or pkg.module:attr>, <parameters>}``, e.g.
    ``[{name: learned_clip_contrastive, path: runs/reward/a0/model}, {name: ..., path: .../a1/model}]``.
    Input as the members take it. ``ValueError`` for an empty list, a member without ``name`` or a
    member returning another shape."""

    name = "ensemble"

    def __init__(self, members: list):
        self.members = [(name, build_from_spec(RewardSpec(name, 1.0, params), f"ensemble.members.{i}"))
                        for i, (name, params) in enumerate(_member_specs(members, "ensemble"))]

    @staticmethod
    def check_params(params: dict, key: str) -> None:
        """Config-time check of every member (name known, parameters accepted), nothing built;
        ``ValueError`` naming ``<key>.members.<i>``."""
        for i, (name, member_params) in enumerate(_member_specs(params.get("members"), key)):
            check_reward_weights({name: {"weight": 1.0, **member_params}}, f"{key}.members.{i}")

    def __call__(self, images, prompts=None, metadata=None) -> torch.Tensor:
        b = images.shape[0]
        scores = []
        for name, reward in self.members:
            s = torch.as_tensor(reward(images, prompts, metadata), dtype=torch.float32).cpu()
            if s.shape != (b,):
                raise ValueError(f"ensemble: member '{name}' returned shape {tuple(s.shape)} for {b} samples")
            scores.append(s)
        return torch.stack(scores).nanmean(dim=0)


def _member_specs(members, key: str) -> list[tuple[str, dict]]:
    """(name, parameters) of each member entry; ``ValueError`` naming ``<key>.members[.i]``."""
    if not members:
        raise ValueError(f"{key}.members: give at least one {{name: ..., <parameters>}} entry")
    out = []
    for i, spec in enumerate(members):
        if not hasattr(spec, "keys"):
            raise ValueError(f"{key}.members.{i}: must be a mapping {{name: ..., <parameters>}}, got {spec!r}")
        params = dict(spec)
        name = params.pop("name", None)
        if not name:
            raise ValueError(f"{key}.members.{i}: missing 'name' (a reward name or pkg.module:attr)")
        out.append((str(name), params))
    return out
