"""The rollout buffer: what one sampling pass recorded, and the settings it was sampled with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pretrain.text_encoder import PromptEmbeds


@dataclass(frozen=True)
class SamplingSettings:
    """What a trajectory was sampled with, read back (never rebuilt) when its log-probs are recomputed.

    ``step``: the step type's name (:mod:`rollout.steps`); ``sigmas``: float32 ``[T + 1]``, the
    schedule walked; ``timesteps``: float32 ``[T]``, the timestep the denoiser received at each
    transition (the adapter's convention, e.g. sigma * 1000 for SD3; the sigmas where the adapter
    declares none); ``noise_level``; ``guidance_scale``; ``negative``: the negative-prompt embedding
    ``[1, ...]`` of the unconditional branch and ``negative_prompt`` its text; ``window``: the SDE
    window [lo, hi) of this iteration (None: every transition stochastic); ``ode_solver``: the solver
    of the deterministic transitions after the window (:mod:`rollout.ode_solver`; ``euler`` = the step
    type at noise level 0). The recomputation of a window transition does not read ``ode_solver``.
    ``experts``: for a mixture of denoisers (Wan2.2 A14B), which expert took each transition (``T``
    ints, :meth:`pretrain.backbone.Backbone.experts`); a recomputation whose model would route a
    transition to another expert raises instead of computing another policy's log-prob. None: one
    denoiser."""

    step: str
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    noise_level: float
    guidance_scale: float
    negative: PromptEmbeds
    negative_prompt: str = ""
    window: tuple[int, int] | None = None
    ode_solver: str = "euler"
    experts: tuple[int, ...] | None = None

    def noise_level_at(self, transitions: list[int]) -> float:
        """The noise level of ``transitions``: ``noise_level`` inside the SDE ``window`` (all of them
        when there is none), 0 (the deterministic step) outside. ``ValueError`` for a mix."""
        if self.window is None:
            return self.noise_level
        inside = {self.window[0] <= t < self.window[1] for t in transitions}
        if len(inside) > 1:
            raise ValueError(f"transitions {transitions} mix the SDE window {self.window} and deterministic steps")
        return self.noise_level if inside.pop() else 0.0

    def after_window(self, transition: int) -> bool:
        """True for a transition after the SDE window (taken by ``ode_solver``); False without a window."""
        return self.window is not None and transition >= self.window[1]

    def same_as(self, other: "SamplingSettings") -> bool:
        """True when ``other`` records the same step, schedule, noise level, guidance, negative prompt,
        window, ODE solver and experts."""
        def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # settings of one sampler share their tensors
            return a is b or torch.equal(a.cpu(), b.cpu())

        return other is self or (
            (self.step, self.noise_level, self.guidance_scale, self.negative_prompt, self.window, self.ode_solver,
             self.experts)
            == (other.step, other.noise_level, other.guidance_scale, other.negative_prompt, other.window,
                other.ode_solver, other.experts)
            and same(self.sigmas, other.sigmas) and same(self.timesteps, other.timesteps)
            and same(self.negative.tokens, other.negative.tokens) and same(self.negative.pooled, other.negative.pooled))


@dataclass
class Trajectory:
    """``latents``: float32 ``[B, T + 1, C, h, w]`` (x at sigmas[0..T]); ``log_probs``: float32 ``[B, T]``
    (per-element-mean log-density of transition t); ``settings``: :class:`SamplingSettings` (shared by
    every sample); ``embeds``: prompt embeddings ``[B, ...]``; ``images``: float32 ``[B, 3, H, W]`` in
    [0, 1] (videos ``[B, F, 3, H, W]``); ``prompts``: B strings; ``group_ids``: long ``[B]`` (prompt
    group); ``sample_ids``: long ``[B]`` global sample indices (the seeding key); ``uncond_velocities``:
    float32 ``[B, T, *latent]``, the unconditional CFG branch's velocity at latents[:, t], when the
    rollout recorded it (``record_uncond``), else None; ``versions``: long ``[B]``, the policy version
    (iterations trained) each sample was drawn with, when a rollout engine records it (None = the
    current policy's); ``old_log_probs``: float32 ``[B, T]``, the log-probs of the policy at the start of
    the update recomputed in training's layout (``grpo.old_log_prob: recompute``; NaN at transitions not
    trained), else None (``log_probs``, the behaviour policy's, serve as the old ones); ``means``: float32
    ``[B, T, *latent]``, the mean of each transition's Gaussian under the policy that drew it (its
    ``SDEStep.mean``), when the rollout recorded them (``record_means``: losses that need the old policy's
    per-step Gaussian, Flow-DPPO and GRPO-Guard), else None; ``sources``: float32 ``[B, 3, H, W]`` in
    [0, 1], each sample's conditioning image decoded by the codec that decoded ``images`` (an edit's source
    image, an image-to-video clip's first frame), when its prompt carries one (``embeds.images``), else
    None: what a reward reads as ``metadata["source_images"]`` (:meth:`reward_metadata`)."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    settings: SamplingSettings
    embeds: PromptEmbeds
    images: torch.Tensor
    prompts: list[str]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    uncond_velocities: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    means: torch.Tensor | None = None
    sources: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    def reward_metadata(self, iteration: int) -> dict:
        """The ``metadata`` a reward is called with (:mod:`rewards.base`): ``sample_ids``, ``group_ids``,
        ``iteration``, and ``source_images`` (``sources``) when the prompts carry conditioning images."""
        meta = {"sample_ids": self.sample_ids, "group_ids": self.group_ids, "iteration": iteration}
        if self.sources is not None:
            meta["source_images"] = self.sources
        return meta

    @property
    def sigmas(self) -> torch.Tensor:
        """The schedule the trajectory was sampled on, float32 ``[T + 1]``."""
        return self.settings.sigmas

    def to(self, device) -> "Trajectory":
        """A copy with every tensor (settings and embeddings included) on ``device``."""
        def move(t):
            return None if t is None else t.to(device)

        s = self.settings
        settings = dataclasses.replace(s, negative=s.negative.to(device))
        return Trajectory(move(self.latents), move(self.log_probs), settings, self.embeds.to(device),
                          move(self.images), list(self.prompts), move(self.group_ids), move(self.sample_ids),
                          move(self.uncond_velocities), move(self.versions), move(self.old_log_probs),
                          move(self.means), move(self.sources))

    def select(self, idx: torch.Tensor) -> "Trajectory":
        """The samples at ``idx`` (long ``[k]``), same settings."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        dev = idx.to(self.latents.device)
        return Trajectory(self.latents[dev], self.log_probs[dev], self.settings, self.embeds[dev],
                          self.images[idx.to(self.images.device)], [self.prompts[i] for i in idx.tolist()],
                          self.group_ids[idx], self.sample_ids[idx],
                          _take(self.uncond_velocities, dev), _take(self.versions, idx),
                          _take(self.old_log_probs, dev), _take(self.means, dev), _take(self.sources, dev))

    @staticmethod
    def cat(items: list["Trajectory"]) -> "Trajectory":
        """One trajectory of ``items`` in order; ``ValueError`` if they were sampled with different settings."""
        if any(not items[0].settings.same_as(t.settings) for t in items[1:]):
            raise ValueError("Trajectory.cat: the trajectories were sampled with different settings")
        return Trajectory(
            torch.cat([t.latents for t in items]), torch.cat([t.log_probs for t in items]), items[0].settings,
            PromptEmbeds.cat([t.embeds for t in items]), torch.cat([t.images for t in items]),
            [p for t in items for p in t.prompts], torch.cat([t.group_ids for t in items]),
            torch.cat([t.sample_ids for t in items]),
            _cat([t.uncond_velocities for t in items]), _cat([t.versions for t in items]),
            _cat([t.old_log_probs for t in items]), _cat([t.means for t in items]), _cat([t.sources for t in items]),
        )


def _take(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[idx.to(t.device)]


def _cat(items: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The concatenation, or None when any item lacks the field."""
    return None if any(t is None for t in items) else torch.cat(items)


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
