"""Collect one iteration's rollouts: prompt groups -> batched SDE sampling -> one Trajectory."""

from __future__ import annotations

import time
from typing import Callable

import torch

from pretrain.data.dataset import EncodedSet
from pretrain.text_encoder import PromptEmbeds
from rollout.sampler import sde_rollout
from rollout.trajectory import Trajectory


class TimedCodec:
    """A codec whose ``decode`` time (seconds) accumulates in ``seconds``."""

    def __init__(self, codec):
        self.codec, self.seconds = codec, 0.0

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.codec.decode(latents)
        self.seconds += time.perf_counter() - t0
        return out


def collect_rollouts(model, codec, prompts: EncodedSet, prompt_idx: list[int], group_size: int, batch_size: int,
                     null: PromptEmbeds, sigmas: torch.Tensor, noise_level: float, guidance_scale: float,
                     latent_shape: tuple[int, ...], seed: int, iteration: int, device,
                     sample_offset: int = 0, on_batch: Callable[[Trajectory], None] | None = None,
                     shared_initial_noise: bool = False, record_uncond: bool = False) -> Trajectory:
    """``group_size`` samples for each prompt in ``prompt_idx`` (indices into ``prompts``). Sample
    ``p * group_size + g`` (plus ``sample_offset``, a rank's share start) is the global index that
    seeds its noise; its group id is ``p``. Sampled in batches of ``batch_size``.

    ``on_batch(batch_trajectory)`` is called, in batch order, as soon as each batch is decoded (e.g. to
    submit its reward scoring while the next batch samples). ``shared_initial_noise``: a group's samples
    start from one initial noise (``rollout_noise``'s ``shared_group_size``); ``record_uncond``: keep
    the unconditional CFG velocities (see :func:`rollout.sampler.sde_rollout`)."""
    n = len(prompt_idx) * group_size
    if shared_initial_noise and sample_offset % group_size:
        raise ValueError(f"collect_rollouts: sample_offset {sample_offset} is not on a group boundary "
                         f"(group_size {group_size}): shared initial noise would straddle groups")
    out = []
    for start in range(0, n, batch_size):
        ids = list(range(start, min(n, start + batch_size)))
        groups = [i // group_size for i in ids]
        _, embeds, captions = prompts.batch([prompt_idx[g] for g in groups])
        out.append(sde_rollout(model, codec, embeds, null, captions, torch.as_tensor(groups),
                               [sample_offset + i for i in ids], sigmas, noise_level, guidance_scale,
                               latent_shape, seed, iteration, device,
                               group_size if shared_initial_noise else None, record_uncond))
        if on_batch is not None:
            on_batch(out[-1])
    return Trajectory.cat(out)
