"""The reward-model protocol, the registry, and weighted composition.

Protocol: ``reward(images, prompts, metadata) -> Tensor[B]`` float32, where ``images`` is
float32 ``[B, 3, H, W]`` in [0, 1] (videos ``[B, F, 3, H, W]``); NaN means "not applicable to this
sample". Any conversion (PIL, resizing, a model's normalisation) happens inside the reward, once.
This package imports nothing else of the project.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class RewardModel(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor: ...


REGISTRY: dict[str, Callable[..., RewardModel]] = {}


def register(name: str):
    """Class/function decorator adding a reward factory to the registry under ``name``."""

    def wrap(factory):
        if name in REGISTRY:
            raise ValueError(f"reward '{name}' is already registered")
        REGISTRY[name] = factory
        return factory

    return wrap


def known_rewards() -> list[str]:
    """Names of the registered rewards (built-ins included)."""
    from rewards import jpeg  # noqa: F401  (registers the built-ins)

    return sorted(REGISTRY)


def check_reward_weights(weights: dict[str, float], key: str = "rewards") -> None:
    """``ValueError`` naming ``key`` unless some reward has a non-zero weight and every name is
    registered."""
    if not any(w != 0 for w in weights.values()):
        raise ValueError(f"{key}: at least one reward with a non-zero weight is required, "
                         f"e.g. {{jpeg_compressibility: 1.0}}")
    unknown = sorted(set(weights) - set(known_rewards()))
    if unknown:
        raise ValueError(f"{key}: unknown reward(s) {unknown}; known: {known_rewards()}")


def build_reward(name: str, **kwargs) -> RewardModel:
    """Instantiate a registered reward; ``ValueError`` naming the known ones if unknown."""
    from rewards import jpeg  # noqa: F401  (registers the built-ins)

    if name not in REGISTRY:
        raise ValueError(f"unknown reward '{name}'; known: {sorted(REGISTRY)}")
    return REGISTRY[name](**kwargs)


def weighted_sum(per_reward: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Combine ``{name: Tensor[B]}`` with ``weights``: NaN components are skipped and the remaining
    weights renormalised (by the sum of their absolute values over the sum of all absolute weights);
    all-NaN samples stay NaN. float32 ``[B]``."""
    names = list(per_reward)
    values = torch.stack([per_reward[n].float() for n in names])  # [R, B]
    w = torch.tensor([float(weights[n]) for n in names]).unsqueeze(1)
    present = ~torch.isnan(values)
    num = torch.where(present, values * w, torch.zeros_like(values)).sum(0)
    total = w.abs().sum()
    cover = torch.where(present, w.abs(), torch.zeros_like(values)).sum(0)
    out = num * total / cover.clamp(min=1e-12)
    return torch.where(present.any(0), out, torch.full_like(out, float("nan")))


class CompositeReward:
    """``{name: weight}`` -> one callable returning (weighted sum ``[B]``, ``{name: raw [B]}``).
    Rewards with weight 0 are not built (a config override can switch one off)."""

    def __init__(self, weights: dict[str, float]):
        weights = {name: w for name, w in weights.items() if w != 0}
        if not weights:
            raise ValueError("rewards: at least one reward is required, e.g. {jpeg_compressibility: 1.0}")
        self.weights = dict(weights)
        self.models = {name: build_reward(name) for name in self.weights}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None):
        raw = {}
        for name, model in self.models.items():
            r = torch.as_tensor(model(images, prompts, metadata), dtype=torch.float32).flatten()
            if r.shape[0] != images.shape[0]:
                raise ValueError(f"reward '{name}' returned {r.shape[0]} values for {images.shape[0]} images")
            raw[name] = r
        return weighted_sum(raw, self.weights), raw
