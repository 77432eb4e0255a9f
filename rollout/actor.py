"""The rollout actor: what sampling needs, held in one object with two verbs (verl's rollout role).

``sample(request)`` draws one :class:`rollout.records.RolloutRequest` batch (a Ray worker's call),
``rollout(prompt_idx, ...)`` draws ``group_size`` samples for each prompt of a rank's share in
``batch_size`` batches (the colocated engine's call). Both run the same
:class:`rollout.sampler.Sampler` with the same model, codec, precision and noise keys (the global sample
ids), so a request sampled anywhere equals the colocated samples of the same ids. What model to sample
with, and whether to keep the unconditional CFG velocities, are decided by whoever builds the actor
(the trainer's factory): here they are plain values.
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager

import torch

from pretrain.data.dataset import EncodedSet
from pretrain.runtime.precision import Precision
from rollout.records import RolloutRequest, RolloutResult
from rollout.sampler import Sampler
from rollout.timed_codec import TimedCodec
from rollout.trajectory import SamplingSettings, Trajectory


class RolloutActor:
    """Everything sampling needs, keyword-only:

    - ``model``: called once per :meth:`sample` / :meth:`rollout`, returns a context manager whose
      ``with`` gives the module to sample with, in eval mode (a :class:`pretrain.backbone.Backbone`: the
      policy, its LoRA-merged copy, the policy with other weights swapped in until the block ends, ...);
    - ``codec``: latents -> images float32 ``[B, 3, H, W]`` in [0, 1] (``[B, F, 3, H, W]`` for video);
    - ``sampler``: the :class:`rollout.sampler.Sampler` of the ``rollout:`` block;
    - ``prompts``: the training prompt set (:class:`pretrain.data.dataset.EncodedSet`), indexed by
      prompt id;
    - ``latent_shape``: one sample's latent shape (e.g. ``(C, h, w)``);
    - ``seed``: the run's seed (keys the noise with the iteration and the global sample id);
    - ``precision``: the autocast sampling runs in (fp32 / bf16 / fp16);
    - ``record_uncond``: keep the unconditional CFG velocities on the trajectories (the update may
      reuse them only when they are its own: decided once by the builder);
    - ``record_means``: keep each transition's Gaussian mean (``Trajectory.means``; the loss needs the
      old policy's per-step Gaussian);
    - ``device``: where sampling runs.

    ``decode_seconds``: seconds the last call spent decoding latents to images."""

    def __init__(self, *, model: Callable[[], ContextManager[torch.nn.Module]], codec, sampler: Sampler, prompts: EncodedSet,
                 latent_shape: tuple[int, ...], seed: int, precision: Precision, record_uncond: bool,
                 device: torch.device, record_means: bool = False):
        self.model, self.codec, self.sampler, self.prompts = model, codec, sampler, prompts
        self.latent_shape, self.seed, self.precision = tuple(latent_shape), seed, precision
        self.record_uncond, self.device, self.record_means = bool(record_uncond), device, bool(record_means)
        self.decode_seconds = 0.0

    def settings(self, iteration: int) -> SamplingSettings:
        """The sampling settings every trajectory of ``iteration`` records (its SDE window included)."""
        return self.sampler.settings_for(self.seed, iteration)

    @torch.no_grad()
    def sample(self, request: RolloutRequest, *, version: int = 0, worker: int = 0) -> RolloutResult:
        """Sample ``request``'s B samples (prompt ids into ``prompts``, noise keyed by its sample ids,
        its iteration's settings) with the weights of ``version`` (iterations trained; recorded on
        ``Trajectory.versions``, long ``[B]``). Returns the result with CPU tensors, ``worker`` as its
        worker index and the seconds taken."""
        t0 = time.perf_counter()
        codec = TimedCodec(self.codec)
        _, embeds, captions = self.prompts.batch(list(request.prompt_ids))
        cfg = self.sampler.cfg
        with self.model() as model, self.precision.autocast():
            traj = self.sampler.sample(model, codec, embeds, captions, group_ids=torch.as_tensor(request.group_ids),
                                       sample_ids=list(request.sample_ids), latent_shape=self.latent_shape,
                                       seed=self.seed, iteration=request.iteration, device=self.device,
                                       shared_group_size=cfg.group_size if cfg.shared_initial_noise else None,
                                       record_uncond=self.record_uncond, record_means=self.record_means)
        traj.versions = torch.full((len(traj),), version, dtype=torch.long)
        self.decode_seconds = codec.seconds
        return RolloutResult(request.request_id, request.iteration, traj.to("cpu"), version, worker,
                             time.perf_counter() - t0, codec.seconds)

    def rollout(self, prompt_idx: list[int], *, iteration: int, sample_offset: int = 0,
                on_batch: Callable[[Trajectory], None] | None = None) -> Trajectory:
        """``group_size`` samples for each prompt in ``prompt_idx`` (indices into ``prompts``), in
        ``batch_size`` batches (:meth:`rollout.sampler.Sampler.rollout`): sample ``p * group_size + g +
        sample_offset`` is the global id keying its noise, its group id ``p``. ``on_batch`` is called
        with each batch as soon as it is decoded. Tensors stay on ``device``. Raises ``ValueError`` when
        shared initial noise is on and ``sample_offset`` is not on a group boundary."""
        codec = TimedCodec(self.codec)
        with self.model() as model, self.precision.autocast():
            traj = self.sampler.rollout(model, codec, self.prompts, prompt_idx, latent_shape=self.latent_shape,
                                        seed=self.seed, iteration=iteration, device=self.device,
                                        sample_offset=sample_offset, on_batch=on_batch,
                                        record_uncond=self.record_uncond, record_means=self.record_means)
        self.decode_seconds = codec.seconds
        return traj
