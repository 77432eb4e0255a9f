"""The policy update of the forward-process losses (DiffusionNFT, AWM, DGPO): no log-probs, the
loss is computed on the forward (noising) process of each rollout's clean sample x0 = the last latent.

Per sample (or per prompt group, when the loss shares draws within a group), from the generator
(seed, "forward", iteration, epoch, key): ``timesteps_per_sample`` distinct indices among the first
max(1, floor(``timestep_fraction`` x T)) sigmas of the rollout's own schedule, and one noise per
index; x_t = (1 - sigma) x0 + sigma eps. Each draw is one forward of the policy (conditional
branch only, as the methods train) and one backward of loss / K. Mini-batches are shuffled by
(seed, "shuffle", iteration, epoch) over samples, or over whole groups for a loss with
``needs_groups``; ``runtime.cfg.grad_accum`` mini-batches per optimizer step. The old copy
(:mod:`posttrain.grpo.old_policy`), when the loss keeps one, follows the policy after the iteration.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ClassVar, ContextManager

import torch

from posttrain.grpo.old_policy import OldPolicy
from posttrain.grpo.perf import PerfConfig, apply_preset, no_grad_model
from posttrain.grpo.ranks import global_count_weight
from posttrain.grpo.extra_loss import ExtraLoss, add_extra
from pretrain.flow import interpolate
from pretrain.runtime.accumulate import Accumulation
from pretrain.seeding import generator_for
from pretrain.text_encoder import PromptEmbeds
from rollout.trajectory import Trajectory


@dataclass
class ForwardDraw:
    """The forward-process draws a loss trains on (each loss's ``Config`` has these keys):
    ``timesteps_per_sample`` K distinct sigmas per sample, among the first
    max(1, floor(``timestep_fraction`` x T)) of the rollout's T schedule sigmas (from sigma_0 = the
    noisiest); ``shared_in_group``: every sample of a prompt group gets the same sigmas and noise."""

    timesteps_per_sample: int = 4
    timestep_fraction: float = 1.0
    shared_in_group: bool = False

    def check_draw(self, prefix: str = "") -> None:
        if self.timesteps_per_sample < 1:
            raise ValueError(f"{prefix}timesteps_per_sample: must be >= 1, got {self.timesteps_per_sample}")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"{prefix}timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")

    def candidates(self, steps: int, prefix: str = "") -> int:
        """How many of a ``steps``-transition schedule's sigmas the draws pick from; ``ValueError`` naming
        ``{prefix}timesteps_per_sample`` when that is more than them."""
        candidates = max(1, int(self.timestep_fraction * steps + 1e-9))
        if self.timesteps_per_sample > candidates:
            raise ValueError(f"{prefix}timesteps_per_sample: {self.timesteps_per_sample} > the {candidates} schedule "
                             f"sigmas timestep_fraction {self.timestep_fraction} leaves of {steps}")
        return candidates


@dataclass
class ForwardBatch:
    """One forward-process draw of a mini-batch of B samples: ``x0``, ``noise``, ``x_t`` float32
    ``[B, ...]``; ``sigma`` float32 ``[B]``; ``advantages`` float32 ``[B]``; ``mask`` bool ``[B]``
    (False: NaN reward or not selected); ``group_ids`` long ``[B]``; ``velocity`` the policy's
    conditional velocity at (x_t, sigma) with gradient. :meth:`old_velocity` and
    :meth:`reference_velocity` run the old copy and the reference model without gradient, once."""

    x0: torch.Tensor
    noise: torch.Tensor
    sigma: torch.Tensor
    x_t: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    group_ids: torch.Tensor
    velocity: torch.Tensor
    _old: Callable[[], torch.Tensor]
    _ref: Callable[[], torch.Tensor]
    _cache: dict = field(default_factory=dict)

    def old_velocity(self) -> torch.Tensor:
        if "old" not in self._cache:
            self._cache["old"] = self._old()
        return self._cache["old"]

    def reference_velocity(self) -> torch.Tensor:
        if "ref" not in self._cache:
            self._cache["ref"] = self._ref()
        return self._cache["ref"]


def draw_keys(traj: Trajectory, shared_in_group: bool) -> list[int]:
    """The generator key of each sample: its global sample index, or (``shared_in_group``) the smallest
    global index of its group, so a group's samples draw alike on every rank layout."""
    ids = traj.sample_ids.tolist()
    if not shared_in_group:
        return ids
    first: dict[int, int] = {}
    for g, i in zip(traj.group_ids.tolist(), ids):
        first[g] = min(first.get(g, i), i)
    return [first[g] for g in traj.group_ids.tolist()]


def forward_draws(traj: Trajectory, draw: ForwardDraw, seed: int, iteration: int, epoch: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma float32 ``[B, K]``, noise float32 ``[B, K, ...]``) on the trajectory's device, from the
    schedule ``traj.sigmas``; see :class:`ForwardDraw`."""
    sigmas = traj.sigmas.float().cpu()
    candidates = draw.candidates(len(sigmas) - 1)
    shape = traj.latents.shape[2:]
    sig, noise = [], []
    for key in draw_keys(traj, draw.shared_in_group):
        g = generator_for(seed, "forward", iteration, epoch, key)
        idx = torch.randperm(candidates, generator=g)[:draw.timesteps_per_sample]
        sig.append(sigmas[idx])
        noise.append(torch.randn((draw.timesteps_per_sample, *shape), generator=g))
    dev = traj.latents.device
    return torch.stack(sig).to(dev), torch.stack(noise).to(dev)


def shuffled_batches(traj: Trajectory, mini_batch_size: int, generator: torch.Generator, whole_groups: bool
                     ) -> list[torch.Tensor]:
    """Index tensors of the mini-batches of one epoch: a permutation of the samples cut every
    ``mini_batch_size``, or (``whole_groups``) of the prompt groups, each mini-batch whole groups.
    ``ValueError`` naming ``train.batch_size`` when groups do not fill mini-batches evenly."""
    n = len(traj)
    if not whole_groups:
        perm = torch.randperm(n, generator=generator)
        return [perm[s:s + mini_batch_size] for s in range(0, n, mini_batch_size)]
    groups = torch.unique(traj.group_ids)
    size = n // len(groups)
    if mini_batch_size % size:
        raise ValueError(f"train.batch_size: this loss compares the samples of a prompt group, so a mini-batch "
                         f"must hold whole groups of {size}; {mini_batch_size} is not a multiple")
    order = groups[torch.randperm(len(groups), generator=generator)]
    members = [torch.nonzero(traj.group_ids == g).flatten() for g in order]
    per = mini_batch_size // size
    return [torch.cat(members[s:s + per]) for s in range(0, len(members), per)]


class ForwardProcessUpdate:
    """One iteration's update with a forward-process loss part (``parts.loss``, a
    :class:`posttrain.grpo.parts.base.LossPart` with ``update = "forward"`` and ``draw``, its
    :class:`ForwardDraw` options; its ``old_decay`` (:class:`posttrain.grpo.old_policy.OldDecay`), when
    set, keeps an old copy). Same call as :class:`posttrain.grpo.update.GRPOUpdate`. The ``"forward"``
    update engine: it provides whole-group mini-batches and an old copy to train against or sample
    with (``supports``), under ``torchrun`` too (``distributed``): each data-parallel rank trains its
    share of the prompt groups (whole groups, as the rollout shares them), the draws are keyed by
    global sample index, and the loss is rescaled so that FSDP2's average over ranks is the mean over
    all ranks' valid samples (:func:`posttrain.grpo.ranks.global_count_weight`; over groups for a loss
    with ``needs_groups``)."""

    supports: ClassVar[frozenset[str]] = frozenset({"needs_groups", "keeps_old", "rollout_with_old"})
    distributed: ClassVar[bool] = True

    def __init__(self, cfg, perf: PerfConfig | None, parts, policy):
        self.cfg, self.perf, self.parts = cfg, apply_preset(perf or PerfConfig(merge_lora=False)), parts
        decay = parts.loss.old_decay
        self.old = OldPolicy(policy.model, decay) if decay is not None else None

    def stateful(self) -> dict:
        """State to checkpoint: the old copy's weights."""
        return {} if self.old is None else {"grpo.old_policy": self.old}

    def rollout_model(self, policy, version: int) -> ContextManager[torch.nn.Module]:
        """``with update.rollout_model(policy, version) as model:`` the module to sample rollouts with:
        the policy with the old weights swapped in when the loss samples with them, else the policy
        (its LoRA-merged copy with ``perf.merge_lora``)."""
        if self.old is not None and self.parts.loss.rollout_with_old:
            return self.old.running(policy.model)
        return nullcontext(no_grad_model(self.perf, policy, version))

    def __call__(self, policy, runtime, traj: Trajectory, advantages: torch.Tensor, mask: torch.Tensor, *,
                 transitions: list[int], mini_batch_size: int, seed: int, iteration: int, dp_group=None,
                 extra: ExtraLoss | None = None) -> list[dict]:
        """Inner epochs of mini-batches over ``traj`` (``transitions`` is unused: the loss draws its own
        sigmas). ``advantages`` float32 ``[N]``, ``mask`` bool ``[N]``; ``extra``: a term added to every
        mini-batch's loss (:data:`posttrain.grpo.extra_loss.ExtraLoss`). Returns per-mini-batch stats."""
        loss_fn, draw, acc = self.parts.loss, self.parts.loss.draw, Accumulation(runtime)
        x0_all = traj.latents[:, -1]
        out = []
        policy.model.train()
        for epoch in range(self.cfg.inner_epochs):
            sig_all, noise_all = forward_draws(traj, draw, seed, iteration, epoch)
            gen = generator_for(seed, "shuffle", iteration, epoch)
            batches = shuffled_batches(traj, mini_batch_size, gen, loss_fn.needs_groups)
            for idx in batches:
                dev = idx.to(x0_all.device)
                x0, embeds = x0_all[dev], traj.embeds[dev]
                counted = mask[idx] if not loss_fn.needs_groups else torch.ones_like(mask[idx])
                weight = global_count_weight(counted, dp_group)
                stats: dict[str, float] = {}
                for j in range(draw.timesteps_per_sample):
                    sigma, noise = sig_all[dev, j], noise_all[dev, j]
                    with runtime.autocast():
                        batch = self._batch(policy, x0, noise, sigma, embeds, advantages[idx], mask[idx],
                                            traj.group_ids[idx])
                        loss, s = loss_fn(batch)
                    acc.backward(loss / draw.timesteps_per_sample * weight, loss.item() / draw.timesteps_per_sample)
                    for key, v in s.items():
                        stats[key] = stats.get(key, 0.0) + v / draw.timesteps_per_sample
                add_extra(acc, extra, len(out), stats)
                stats.update(acc.end_micro_batch())
                out.append(stats)
        if self.old is not None:
            out[-1]["old_decay"] = self.old.update(iteration + 1)
        return out

    def _batch(self, policy, x0, noise, sigma, embeds: PromptEmbeds, advantages, mask, group_ids) -> ForwardBatch:
        x_t = interpolate(x0, noise, sigma)
        v_old = None
        if self.old is not None:  # before the policy's forward: the swap writes the weights autograd saves
            with self.old.running(policy.model) as model:
                v_old = model(x_t, sigma, embeds)

        def old() -> torch.Tensor:
            if v_old is None:
                raise ValueError("grpo.loss: this loss reads the old policy but keeps none (old_decay is None)")
            return v_old

        @torch.no_grad()
        def ref() -> torch.Tensor:
            if not self.parts.loss.needs_reference:
                raise ValueError("grpo.loss: this loss reads the reference model but does not declare needs_reference")
            with policy.reference() as ref_model:
                return ref_model(x_t, sigma, embeds)

        return ForwardBatch(x0, noise, sigma, x_t, advantages, mask, group_ids, policy.model(x_t, sigma, embeds),
                            old, ref)
