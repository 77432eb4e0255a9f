"""The reward-model protocol, the registry, reward specs, and weighted composition.

Protocol: ``reward(images, prompts, metadata) -> Tensor[B]`` float32, where ``images`` is
float32 ``[B, 3, H, W]`` in [0, 1] (videos ``[B, F, 3, H, W]``); NaN means "not applicable to this
sample". Any conversion (PIL, resizing, a model's normalisation) happens inside the reward, once.
``metadata`` (may be None) holds, from GRPO: ``sample_ids`` (each sample's global index in the iteration),
``group_ids`` (its prompt group within the batch) and ``iteration``; from GRPO, evaluation and the sweep's
probes, when the prompts carry conditioning images (editing, image-to-video): ``source_images``, float32
``[B, 3, H, W]`` in [0, 1], each sample's conditioning image. A reward whose class sets
``groupwise = True`` scores a sample against the others of its group (``pairwise_remote``); GRPO then
requires rollout batches of whole groups (:func:`groupwise_rewards`).
This package imports nothing else of the project.

Config form (``rewards:``): each entry is ``name: weight`` or ``name: {weight: w, <parameters>}``;
``name`` is a registered reward or an import path ``pkg.module:attr`` (see ``resolve_factory``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable, Mapping, Protocol

import torch

from pretrain.registry import Registry, import_path
from rewards.specs import RewardSpec, is_import_path, parse_reward_spec, parse_reward_specs

__all__ = ["RewardModel", "RewardSpec", "REGISTRY", "register", "known_rewards", "check_reward_weights", "groupwise_rewards",
           "build_reward", "differentiable_reward", "build_from_spec", "resolve_factory", "parse_reward_spec",
           "parse_reward_specs", "weighted_sum", "CompositeReward", "builtin_modules"]


class RewardModel(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor: ...


def builtin_modules() -> list[str]:
    """Every module of the ``rewards`` package (importing one registers the rewards it defines; each
    imports its heavy dependencies lazily, inside the reward's constructor). A new built-in reward is
    one file here with ``@register``; nothing else needs editing."""
    import rewards

    return sorted(m.name for m in pkgutil.iter_modules(rewards.__path__) if not m.name.startswith("_"))


def _load_builtins() -> None:
    for module in builtin_modules():
        importlib.import_module(f"rewards.{module}")


#: Reward name -> factory (the built-ins register on first lookup).
REGISTRY: Registry = Registry("reward", key="rewards", load=_load_builtins)


def register(name: str):
    """Class/function decorator adding a reward factory to the registry under ``name`` (``ValueError``
    if another factory holds it)."""
    return REGISTRY.register(name)


def known_rewards() -> list[str]:
    """Names of the registered rewards (built-ins included). Import paths are not listed; they are
    known when importable (``check_reward_weights`` imports them)."""
    return REGISTRY.names()


def resolve_factory(name: str, key: str = "rewards") -> Callable:
    """The object behind a reward name: the registry entry, or for ``pkg.module:attr`` (``attr`` may be
    dotted) the imported attribute. ``ValueError`` naming ``key.name`` for an unknown name, a module
    that fails to import, or a missing attribute."""
    if not is_import_path(name):
        if name not in REGISTRY:
            raise ValueError(f"{key}: unknown reward(s) ['{name}']; known: {REGISTRY.names()} "
                             f"or an import path 'pkg.module:attr'")
        return REGISTRY[name]
    obj = import_path(name, f"{key}.{name}")
    if not callable(obj):
        raise ValueError(f"{key}.{name}: '{name.partition(':')[2]}' is not callable")
    return obj


def _is_reward_function(obj) -> bool:
    """A plain function (not a class) whose first parameter is named ``images`` is a reward itself."""
    if inspect.isclass(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "images"


def _check_params(obj, params: dict, key: str) -> None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        if _is_reward_function(obj):
            sig.bind_partial(None, None, None, **params)
        else:
            sig.bind(**params)
    except TypeError as e:
        raise ValueError(f"{key}: bad parameters {sorted(params)} for {getattr(obj, '__name__', obj)}{sig}: "
                         f"{e}") from e
    check = getattr(obj, "check_params", None)  # a factory that wraps other rewards checks them too
    if callable(check):
        check(params, key)


def build_reward(name: str, **params) -> RewardModel:
    """Instantiate reward ``name`` (registered or ``pkg.module:attr``) with ``params``.

    A class is a factory, instantiated with ``params``; a function whose first parameter is named
    ``images`` is the reward itself (``params`` bound as keyword arguments); any other callable is a
    factory called with ``params`` that must return a reward. ``ValueError`` naming ``rewards.name``
    for an unknown name, an import error, a missing attribute or parameters the factory does not
    accept."""
    return build_from_spec(RewardSpec(name, 1.0, params))


def differentiable_reward(spec: RewardSpec, key: str = "reward") -> Callable[[torch.Tensor, list[str]], torch.Tensor]:
    """The reward of ``spec`` as ``score(images, prompts) -> float32 [B]``, differentiable in ``images``
    (float ``[B, 3, H, W]`` in [0, 1]), for reward-gradient methods. A reward declares itself
    differentiable with the class attribute ``differentiable = True`` and a ``score(images, prompts)``
    method that keeps the graph (its ``__call__`` is that under ``no_grad``). ``ValueError`` naming
    ``key.<name>`` for a reward that is not, listing those that are."""
    model = build_from_spec(spec, key)
    if not getattr(model, "differentiable", False) or not callable(getattr(model, "score", None)):
        known = sorted(n for n in REGISTRY if getattr(REGISTRY[n], "differentiable", False))
        raise ValueError(f"{key}.{spec.name}: not a differentiable reward (no gradient to the images); "
                         f"differentiable: {known} or a class of yours with differentiable = True and score()")
    return model.score


def build_from_spec(spec: RewardSpec, key: str = "rewards") -> RewardModel:
    """``build_reward`` for a parsed spec; errors name ``key.<spec.name>``."""
    name, params = spec.name, spec.params
    factory = resolve_factory(name, key)
    _check_params(factory, params, f"{key}.{name}")
    if _is_reward_function(factory):
        if not params:
            return factory
        return lambda images, prompts=None, metadata=None: factory(images, prompts, metadata, **params)
    model = factory(**params)
    if not callable(model):
        raise ValueError(f"{key}.{name}: the factory returned {type(model).__name__}, not a reward callable")
    return model


def groupwise_rewards(weights: Mapping[str, Any], key: str = "rewards") -> list[str]:
    """The names in a ``rewards:`` block whose factory (or the class it wraps) sets ``groupwise = True``."""
    out = []
    for name in parse_reward_specs(weights, key):
        factory = resolve_factory(name, key)
        if getattr(getattr(factory, "__wrapped__", factory), "groupwise", False):
            out.append(name)
    return out


def check_reward_weights(weights: Mapping[str, Any], key: str = "rewards") -> None:
    """``ValueError`` naming ``key`` unless every entry parses (``name: weight`` or
    ``name: {weight: w, <params>}``), some reward has a non-zero weight, every name is registered or
    importable, and each factory accepts its parameters. Nothing is instantiated."""
    specs = parse_reward_specs(weights, key)
    if not any(s.weight != 0 for s in specs.values()):
        raise ValueError(f"{key}: at least one reward with a non-zero weight is required, "
                         f"e.g. {{jpeg_compressibility: 1.0}}")
    unknown = sorted(n for n in specs if not is_import_path(n) and n not in known_rewards())
    if unknown:
        raise ValueError(f"{key}: unknown reward(s) {unknown}; known: {known_rewards()} "
                         f"or an import path 'pkg.module:attr'")
    for spec in specs.values():
        _check_params(resolve_factory(spec.name, key), spec.params, f"{key}.{spec.name}")


def weighted_sum(per_reward: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Combine ``{name: Tensor[B]}`` with ``weights``: non-finite components (NaN, +/-inf: "not
    applicable") are skipped and the remaining weights renormalised (by the sum of their absolute values
    over the sum of all absolute weights); samples with no finite component are NaN. float32 ``[B]``."""
    names = list(per_reward)
    values = torch.stack([per_reward[n].float() for n in names])  # [R, B]
    w = torch.tensor([float(weights[n]) for n in names]).unsqueeze(1)
    present = torch.isfinite(values)
    num = torch.where(present, values * w, torch.zeros_like(values)).sum(0)
    total = w.abs().sum()
    cover = torch.where(present, w.abs(), torch.zeros_like(values)).sum(0)
    out = num * total / cover.clamp(min=1e-12)
    return torch.where(present.any(0), out, torch.full_like(out, float("nan")))


class CompositeReward:
    """A ``rewards:`` config (``{name: weight}`` or ``{name: {weight: w, <params>}}``) -> one callable
    returning (weighted sum float32 ``[B]``, ``{name: raw float32 [B]}``). Rewards with weight 0 are not
    built (a config override can switch one off). ``ValueError`` as ``check_reward_weights``."""

    def __init__(self, weights: Mapping[str, Any], key: str = "rewards"):
        specs = {n: s for n, s in parse_reward_specs(weights, key).items() if s.weight != 0}
        if not specs:
            raise ValueError(f"{key}: at least one reward is required, e.g. {{jpeg_compressibility: 1.0}}")
        self.specs = specs
        self.weights = {n: s.weight for n, s in specs.items()}
        self.models = {n: build_from_spec(s, key) for n, s in specs.items()}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None):
        raw = {}
        for name, model in self.models.items():
            r = torch.as_tensor(model(images, prompts, metadata), dtype=torch.float32).flatten()
            if r.shape[0] != images.shape[0]:
                raise ValueError(f"reward '{name}' returned {r.shape[0]} values for {images.shape[0]} images")
            raw[name] = r
        return weighted_sum(raw, self.weights), raw
