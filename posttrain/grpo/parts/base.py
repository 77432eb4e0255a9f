"""The base class of a policy loss part: what the loss needs, as typed attributes.

A loss declares which update engine trains it and what that engine must provide; the run's config
is checked against these declarations once, at config load (:func:`check_loss`), from the class,
without building the part: a loss that needs log-probs refuses a deterministic ``rollout.step``, a
capability the update engine lacks is refused naming ``grpo.loss.name``, and so is an update engine
that the rollout engine or the launch (``torchrun``) cannot run. The engines then read the same
attributes (never probed by name).

Class attributes (fixed for the class, checked at config load):

- ``update``: the update engine's name in :data:`UPDATES`: ``"transition"`` (per-transition
  recomputed log-probs, :class:`posttrain.grpo.update.GRPOUpdate`) or ``"forward"`` (the forward
  process of the clean samples, :class:`posttrain.grpo.forward_update.ForwardProcessUpdate`).
- ``needs_log_probs``: trains on the rollout's log-probs (``rollout.step`` must record them).
- ``needs_groups``: mini-batches of whole prompt groups.
- ``keeps_old``: may keep an EMA old copy of the policy (its schedule is ``old_decay``).
- ``rollout_with_old``: samples the rollouts with that old copy.
- ``needs_old_means``: reads the old policy's per-step Gaussian mean (``Trajectory.means``, recorded by
  the rollout; recomputed with the old log-probs under ``grpo.old_log_prob: recompute``).

A loss may also define ``check_options(options, step, prefix)``, a classmethod called at config load with
its options and the ``rollout.step``, to refuse a combination only it knows about (``ValueError`` naming
the key).

Instance attributes (set by the part from its options; the class values are the defaults):

- ``needs_reference``: reads the reference model (adapters disabled, or the frozen copy).
- ``old_decay``: the old copy's schedule (:class:`posttrain.grpo.old_policy.OldDecay`), None: no copy.
"""

from __future__ import annotations

from typing import Any, ClassVar

from posttrain.grpo.old_policy import OldDecay
from pretrain.registry import Registry

#: Capabilities an update engine may provide (its ``supports``), named as the loss part's attributes.
CAPABILITIES = ("needs_log_probs", "needs_groups", "keeps_old", "rollout_with_old", "needs_old_means")

#: ``update`` names -> update engine classes (lazy: imported on use). An engine has ``supports``
#: (a frozenset of :data:`CAPABILITIES`) and ``distributed`` (whether it runs under ``torchrun``).
UPDATES = Registry("update engine", {"transition": "posttrain.grpo.update:GRPOUpdate",
                                     "forward": "posttrain.grpo.forward_update:ForwardProcessUpdate"},
                   key="grpo.loss.name")

#: The update engines each rollout engine can train with (``engine.name`` -> names); not listed: all.
ROLLOUT_ENGINE_UPDATES: dict[str, tuple[str, ...]] = {"ray": ("transition", "forward")}


class LossPart:
    """A registered policy loss (see the module docstring for the attributes; the call contracts are in
    :mod:`posttrain.grpo.parts.registry`)."""

    update: ClassVar[str] = "transition"
    needs_log_probs: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = False
    keeps_old: ClassVar[bool] = False
    rollout_with_old: ClassVar[bool] = False
    needs_old_means: ClassVar[bool] = False
    needs_reference: bool = False
    old_decay: OldDecay | None = None

    @classmethod
    def declared(cls) -> list[str]:
        """The capabilities of :data:`CAPABILITIES` this class declares (true), in that order."""
        return [name for name in CAPABILITIES if getattr(cls, name)]


def check_loss(cls: Any, name: str, *, step: str, rollout_engine: str, world_size: int) -> type[LossPart]:
    """Check the loss class ``cls`` (registered as ``name``) against the run: ``step`` the
    ``rollout.step``, ``rollout_engine`` the ``engine.name``, ``world_size`` the launch's process
    count. Returns its update engine class. ``ValueError`` naming ``grpo.loss.name`` when ``cls`` is
    not a :class:`LossPart`, names an unknown update engine, declares a capability the engine lacks,
    or needs log-probs that ``rollout.step`` does not record; naming ``engine.name`` when that
    engine cannot train with this update engine; naming the launch when the update engine runs in one
    process and ``world_size`` > 1."""
    from rollout.steps import get_step

    if not (isinstance(cls, type) and issubclass(cls, LossPart)):
        raise ValueError(f"grpo.loss.name: '{name}' is not a loss part (subclass "
                         f"posttrain.grpo.parts.base.LossPart and declare what it needs)")
    engine = UPDATES.get(cls.update, "grpo.loss.name")
    lacking = [c for c in cls.declared() if c not in engine.supports]
    if lacking:
        raise ValueError(f"grpo.loss.name: '{name}' declares {', '.join(lacking)}, which its update engine "
                         f"'{cls.update}' lacks (it provides: {', '.join(sorted(engine.supports)) or 'none'})")
    if cls.needs_log_probs and getattr(get_step(step), "deterministic", False):  # optional on a step
        raise ValueError(f"grpo.loss.name: '{name}' trains on the rollout's log-probs; rollout.step "
                         f"'{step}' records none (use sde, cps or ddim, or a forward-process loss: nft, awm, dgpo)")
    allowed = ROLLOUT_ENGINE_UPDATES.get(rollout_engine)
    if allowed is not None and cls.update not in allowed:
        raise ValueError(f"engine.name: {rollout_engine} trains with the update engines {', '.join(allowed)}; "
                         f"grpo.loss.name '{name}' trains with '{cls.update}' (e.g. it samples with its own copy "
                         f"of the policy): use engine.name: local")
    if world_size > 1 and not engine.distributed:
        raise ValueError(f"grpo.loss.name: '{name}' trains with the update engine '{cls.update}', which runs in "
                         f"one process for now; launch without torchrun (WORLD_SIZE={world_size})")
    return engine
