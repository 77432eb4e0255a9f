"""Registries of the post-training algorithms' parts, chosen by name in a config.

A part is a class with a nested ``Config`` dataclass (its options, each documented) and a
constructor taking that config. A built-in part registers itself with ``@ADVANTAGES.register("name")``
(or ``SELECTIONS`` / ``LOSSES``) in its own file under ``posttrain/grpo/parts/`` (every module there is
imported, so a new file needs no other edit); a config then selects it with
``{name: <name>, <option>: <value>, ...}``. A part of your own, outside the project, is named by its
import path, ``name: my_package.my_module:RankAdvantage`` (like rewards), or registered by your own
script before it loads the config. No shared code changes either way.

Contracts (N samples of one iteration, every tensor float32 unless said otherwise):

- advantage estimator: ``part(total [N], raw {reward: [N]}, weights {reward: w}, group_ids long [N],
  prompt_ids long [N]) -> (advantages [N], valid bool [N], zero_spread bool [N])``; NaN rewards are not
  valid and get 0. ``group_ids``: the prompt group within this iteration; ``prompt_ids``: the prompt's
  index in the training prompt set (the same prompt in another iteration has the same id).
- sample selection: ``part(total, advantages, valid, zero_spread, group_ids) -> mask bool [N]``, the
  samples trained this iteration (``total``: the weighted reward, NaN allowed).
- policy loss: a subclass of :class:`posttrain.grpo.parts.base.LossPart` that declares, as typed
  attributes, which update engine trains it (``update``: ``"transition"`` or ``"forward"``, a name in
  :data:`posttrain.grpo.parts.base.UPDATES`) and what it needs (``needs_log_probs``, ``needs_groups``,
  ``keeps_old``, ``rollout_with_old`` on the class; ``needs_reference`` and ``old_decay`` set from its
  options). The config is checked against them when it loads, from the class, without building the
  part (:func:`posttrain.grpo.parts.base.check_loss`): a capability the update engine lacks, log-probs a
  deterministic ``rollout.step`` does not record, an update engine the rollout engine cannot train
  with or that cannot run under ``torchrun`` are config errors naming the key.
  With ``update = "transition"`` (:class:`posttrain.grpo.update.GRPOUpdate`):
  ``part(new, old_log_prob [k], advantages [k], mask bool [k], ref) -> (loss scalar, stats)`` over k
  rows of transitions, ``new``/``ref`` the recomputed steps (:class:`rollout.sde.SDEStep`) of the
  policy and of the reference model; ``ref`` is None unless ``needs_reference`` is true; a part that
  declares ``needs_old_means`` is also given ``old_mean=`` float32 ``[k, *latent]``, the old policy's
  per-step Gaussian means of the same rows.
  With ``update = "forward"`` (:class:`posttrain.grpo.forward_update.ForwardProcessUpdate`; ``nft``,
  ``awm``, ``dgpo``): ``part(batch) -> (loss scalar, stats)`` with ``batch`` a
  :class:`posttrain.grpo.forward_update.ForwardBatch`; the part has ``draw`` (its
  :class:`posttrain.grpo.forward_update.ForwardDraw` options) and sets ``needs_log_probs = False`` (so
  ``rollout.step: ode`` is allowed); ``old_decay`` keeps an EMA old copy (``keeps_old``),
  ``rollout_with_old`` samples with it, ``needs_groups`` makes mini-batches of whole prompt groups.

Parts are built once per run (:meth:`posttrain.grpo.update.GRPOAlgorithmConfig.build`) and handed to
the update engine; checking a config builds none.

A part that keeps state across iterations (e.g. ``per_prompt``'s reward buffers) has ``state_dict()`` /
``load_state_dict(state)``; the run checkpoints it with everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pretrain.config import load_section
from pretrain.registry import Registry


@dataclass
class NoOptions:
    """A part without options."""


def _load_builtins() -> None:
    import posttrain.grpo.parts  # noqa: F401  (importing the package imports every built-in part)


class PartRegistry(Registry):
    """Name -> part class for one ``kind`` of part (used in error messages); a part of the user's own is
    named by its import path ``module.path:ClassName``."""

    def __init__(self, kind: str):
        super().__init__(kind, load=_load_builtins, import_paths=True)

    def build(self, spec: dict[str, Any], key: str):
        """The part ``spec["name"]`` built with the rest of ``spec`` as its ``Config``. ``ValueError``
        naming ``key.name`` (unknown name, listing the known ones) or ``key.<option>`` (bad option)."""
        cls, options = self.options(spec, key)
        return cls(options)

    def options(self, spec: dict[str, Any], key: str) -> tuple[type, Any]:
        """(the part class ``spec["name"]`` names, its ``Config`` loaded from the rest of ``spec`` and
        validated), without building the part. ``ValueError`` as :meth:`build`."""
        name = spec.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{key}.name: a {self.kind} name is required; known: {self.names()}")
        cls = self.get(name, f"{key}.name")
        schema = getattr(cls, "Config", NoOptions)
        options = {k: v for k, v in spec.items() if k != "name"}
        known = [f.name for f in fields(schema)]
        for option in options:
            if option not in known:
                raise ValueError(f"{key}.{option}: not an option of {self.kind} '{name}' (its options: "
                                 f"{', '.join(known) or 'none'}); when switching {key}.name, drop the previous "
                                 f"part's options (on the command line: ~{key}.{option})")
        return cls, load_section(schema, options, key)


ADVANTAGES = PartRegistry("advantage estimator")
SELECTIONS = PartRegistry("sample selection")
LOSSES = PartRegistry("policy loss")

#: The ``grpo:`` block's part keys and their registries.
REGISTRIES = {"advantage": ADVANTAGES, "selection": SELECTIONS, "loss": LOSSES}
