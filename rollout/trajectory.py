"""The rollout buffer: what one SDE sampling pass recorded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.text_encoder import PromptEmbeds


@dataclass
class Trajectory:
    """``latents``: float32 ``[B, T + 1, C, h, w]`` (x at sigmas[0..T]); ``log_probs``: float32 ``[B, T]``
    (per-element-mean log-density of transition t); ``sigmas``: float32 ``[T + 1]``, the schedule used
    (reused, never rebuilt); ``embeds``: prompt embeddings ``[B, ...]``; ``images``: float32
    ``[B, 3, H, W]`` in [0, 1]; ``prompts``: B strings; ``group_ids``: long ``[B]`` (prompt group);
    ``sample_ids``: long ``[B]`` global sample indices (the seeding key); ``uncond_velocities``: float32
    ``[B, T, *latent]`` (``[B, T, C, h, w]``, video ``[B, T, C, F, h, w]``), the unconditional CFG
    branch's velocity at latents[:, t], when the rollout recorded it (``record_uncond``), else None."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    embeds: PromptEmbeds
    images: torch.Tensor
    prompts: list[str]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    uncond_velocities: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, idx: torch.Tensor) -> "Trajectory":
        """The samples at ``idx`` (long ``[k]``), same schedule."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        dev = idx.to(self.latents.device)
        return Trajectory(self.latents[dev], self.log_probs[dev], self.sigmas, self.embeds[dev],
                          self.images[idx.to(self.images.device)], [self.prompts[i] for i in idx.tolist()],
                          self.group_ids[idx], self.sample_ids[idx],
                          None if self.uncond_velocities is None else self.uncond_velocities[dev])

    @staticmethod
    def cat(items: list["Trajectory"]) -> "Trajectory":
        return Trajectory(
            torch.cat([t.latents for t in items]), torch.cat([t.log_probs for t in items]), items[0].sigmas,
            PromptEmbeds.cat([t.embeds for t in items]), torch.cat([t.images for t in items]),
            [p for t in items for p in t.prompts], torch.cat([t.group_ids for t in items]),
            torch.cat([t.sample_ids for t in items]),
            None if any(t.uncond_velocities is None for t in items)
            else torch.cat([t.uncond_velocities for t in items]),
        )


def train_timesteps(num_steps: int, fraction: float, mode: str = "first",
                    generator: torch.Generator | None = None) -> list[int]:
    """Transitions to train: the first floor(fraction * T) (Flow-GRPO; 0.99 of 10 trains 9), or a
    random subset of that size (``mode="random"``, DanceGRPO), sorted. ``ValueError`` otherwise."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {fraction}")
    k = max(1, int(fraction * num_steps + 1e-9))
    if mode == "first":
        return list(range(k))
    if mode == "random":
        return sorted(torch.randperm(num_steps, generator=generator)[:k].tolist())
    raise ValueError(f"timestep_selection: unknown mode '{mode}' (known: first, random)")
