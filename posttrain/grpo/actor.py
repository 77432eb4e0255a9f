"""Prepares the :class:`rollout.actor.RolloutActor` of a GRPO run, the one factory both the colocated
engine (in the trainer) and each Ray rollout worker call, so both sample with the same precision, latent
shape, seed and uncond-recording rule."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager

import torch

from posttrain.grpo.perf import PerfConfig, records_uncond
from pretrain.data.dataset import EncodedSet
from pretrain.runtime.precision import Precision
from rollout.actor import RolloutActor
from rollout.sampler import Sampler


def rollout_precision(cfg) -> str:
    """The autocast the rollout samples in: ``rollout.precision``, else ``train.precision``."""
    return cfg.rollout.precision or cfg.train.precision


def record_uncond(cfg, perf: PerfConfig) -> bool:
    """Whether the rollout keeps its unconditional CFG velocities for the update to reuse: only when the
    update reuses them (:func:`posttrain.grpo.perf.records_uncond`: a detached unconditional branch, not
    ``perf.uncond_in_batch``, CFG on) and they are the update's own: sampled on-policy (``engine.mode:
    sync``) in the update's precision. ``cfg``: a :class:`posttrain.grpo.stage.GRPOConfig`; ``perf``
    resolved (:func:`posttrain.grpo.perf.resolve_perf`)."""
    return (cfg.engine.mode == "sync" and records_uncond(perf, cfg.grpo.detach_uncond, cfg.rollout.guidance_scale)
            and rollout_precision(cfg) == cfg.train.precision)


def build_rollout_actor(cfg, perf: PerfConfig, *, policy, sampling_model: Callable[[], ContextManager[torch.nn.Module]],
                        sampler: Sampler, codec, prompts: EncodedSet, image_size: int, device: torch.device,
                        keep_uncond: bool = True) -> RolloutActor:
    """The rollout actor of the run ``cfg`` (a :class:`posttrain.grpo.stage.GRPOConfig`, ``perf``
    resolved) over ``policy`` (a :class:`posttrain.base.policy.Policy`, put in eval mode with each call):
    ``sampling_model()`` gives a context manager whose ``with`` gives the module to sample with (the
    update's choice in the trainer, the policy or its merged copy at the held weights in a worker); ``sampler``, ``codec`` and ``prompts``
    (the training prompt set) as built from the export; ``image_size`` the export's square size in
    pixels (the latent shape follows from the codec). ``keep_uncond`` False never keeps the
    unconditional velocities, else :func:`record_uncond` decides. Each transition's Gaussian mean is kept
    when the loss part declares ``needs_old_means``. Raises ``ValueError`` for an unknown
    precision."""

    @contextmanager
    def model():
        with sampling_model() as chosen:
            policy.model.eval()
            yield chosen.eval()

    return RolloutActor(model=model, codec=codec, sampler=sampler, prompts=prompts,
                        latent_shape=codec.latent_shape(image_size, image_size), seed=cfg.train.seed,
                        precision=Precision(rollout_precision(cfg), device),
                        record_uncond=keep_uncond and record_uncond(cfg, perf), device=device,
                        record_means=getattr(cfg.grpo.loss_class()[0], "needs_old_means", False))
