"""The rollout sampler: draws trajectories with log-probs and recomputes them later from what the
trajectory recorded (step type, schedule, noise level, guidance, negative prompt), never anew.

One transition (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470, eq. 9-10, step type ``sde``):
v = cfg_combine(v_cond, v_uncond, guidance_scale) (Ho & Salimans 2022; the model family's own rule,
:meth:`pretrain.backbone.Backbone.cfg_combine`), then ``step(x, v, sigma_t, sigma_t+1, noise_level)``
gives x_next and log p(x_next | x). Sampling (:meth:`Sampler.sample`) and the recomputation
(:func:`log_prob`) both combine the branches with it (:func:`pretrain.guidance.combine`) and call the
step type registered under the trajectory's recorded name. With an SDE window, the transitions after it
are taken by the recorded ODE solver (:mod:`rollout.ode_solver`); they are deterministic and never
recomputed. A mixture of denoisers (Wan2.2 A14B) has its expert per transition recorded in the settings,
and a recomputation that would use another raises.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pretrain.codec import decode_conditions
from pretrain.data.dataset import EncodedSet
from pretrain.guidance import cfg_branches, combine, guided_velocity, uses_cfg
from pretrain.seeding import generator_for
from pretrain.text_encoder import PromptEmbeds
from rollout.branches import CFGBranches
from rollout.config import RolloutConfig
from rollout.noise import rollout_noise
from rollout.ode_solver import get_ode_solver
from rollout.steps import get_step
from rollout.trajectory import SamplingSettings, Trajectory, train_timesteps


class Sampler:
    """Built from a ``rollout:`` block (:class:`rollout.config.RolloutConfig`) for one model:
    ``sigmas`` float32 ``[T + 1]`` (the model's schedule at ``num_inference_steps`` and the shift),
    ``negative`` the negative-prompt embedding ``[1, ...]``. Every trajectory it draws carries
    ``self.settings``; :func:`log_prob` reads them back."""

    def __init__(self, cfg: RolloutConfig, sigmas: torch.Tensor, negative: PromptEmbeds,
                 timesteps: torch.Tensor | None = None):
        self.cfg = cfg
        self.step = get_step(cfg.step)
        sigmas = sigmas.float().cpu().clone()
        self.settings = SamplingSettings(cfg.step, sigmas, sigmas[:-1].clone() if timesteps is None else timesteps,
                                         cfg.noise_level, cfg.guidance_scale, negative, cfg.negative_prompt,
                                         ode_solver=cfg.ode_solver)

    @classmethod
    def build(cls, cfg: RolloutConfig, model, encoder, device, shift: float) -> "Sampler":
        """The sampler of ``cfg`` for ``model`` (a :class:`pretrain.backbone.Backbone`): its schedule at
        ``cfg.shift`` (``shift`` where that is None), ``cfg.negative_prompt`` encoded by ``encoder``, and
        the experts of a mixture of denoisers recorded (:meth:`record_experts`), so that settings compared
        with a rollout worker's match before this process samples."""
        sigmas = model.sigmas(cfg.num_inference_steps, shift if cfg.shift is None else cfg.shift)
        negative = encoder.encode([cfg.negative_prompt]).to(device)
        sampler = cls(cfg, sigmas, negative, model.timestep(sigmas[:-1]).float().cpu().clone())
        sampler.record_experts(model)
        return sampler

    @property
    def num_steps(self) -> int:
        return len(self.settings.sigmas) - 1

    def window(self, seed: int, iteration: int) -> tuple[int, int] | None:
        """The SDE window [lo, hi) of ``iteration``: (0, 0) for a deterministic step type (every
        transition after it, taken by ``ode_solver``), None when every transition is stochastic."""
        if getattr(self.step, "deterministic", False):
            return 0, 0
        return self.cfg.sde_window.bounds(self.num_steps, seed, iteration)

    def record_experts(self, model) -> None:
        """Record in ``self.settings`` which expert of ``model`` takes each transition
        (:meth:`pretrain.backbone.Backbone.experts`; nothing for a single denoiser). ``ValueError`` when a
        model routes differently from the one recorded before (another boundary)."""
        experts_of = getattr(model, "experts", None)  # a Backbone's; a bare test module has none
        routed = None if experts_of is None else experts_of(self.settings.sigmas[:-1])
        experts = None if routed is None else tuple(int(e) for e in routed.tolist())
        if experts != self.settings.experts:
            if self.settings.experts is not None:
                raise ValueError(f"rollout: the model routes the transitions to experts {experts}, this sampler "
                                 f"recorded {self.settings.experts}")
            self.settings = dataclasses.replace(self.settings, experts=experts)

    def settings_for(self, seed: int, iteration: int) -> SamplingSettings:
        """The settings of ``iteration``: ``self.settings`` with that iteration's SDE window."""
        window = self.window(seed, iteration)
        return self.settings if window is None else dataclasses.replace(self.settings, window=window)

    def train_transitions(self, seed: int, iteration: int) -> list[int]:
        """The transitions trained this iteration: the SDE window's (none for a deterministic step
        type), or without one ``timestep_fraction`` / ``timestep_selection`` (a random subset is drawn
        from (seed, "train", iteration))."""
        window = self.window(seed, iteration)
        if window is not None:
            return list(range(*window))
        return train_timesteps(self.num_steps, self.cfg.timestep_fraction, self.cfg.timestep_selection,
                               generator_for(seed, "train", iteration))

    @torch.no_grad()
    def sample(self, model, codec, embeds: PromptEmbeds, prompts: list[str], *, group_ids: torch.Tensor,
               sample_ids: list[int], latent_shape: tuple[int, ...], seed: int, iteration: int, device,
               shared_group_size: int | None = None, record_uncond: bool = False,
               record_means: bool = False) -> Trajectory:
        """One batch of B samples: every latent and log-prob, images decoded by ``codec`` (float32 in
        [0, 1]). The first state is the unit noise of :func:`rollout.noise.rollout_noise` (keyed by
        ``sample_ids``, the global indices) times ``model.initial_scale(sigmas[0])``. Transitions after
        the SDE window take ``settings.ode_solver``, given the previous transition's (x, v, sigma).
        ``record_uncond``: keep the unconditional branch's velocities (``Trajectory.uncond_velocities``,
        with CFG only) so that training before the first optimizer step may reuse them. ``record_means``:
        keep each transition's Gaussian mean (``Trajectory.means``). Conditioning images of the prompts
        (``embeds.images``) are decoded by ``codec`` too (``Trajectory.sources``). The experts of a mixture of denoisers
        are recorded in the settings (:meth:`record_experts`)."""
        self.record_experts(model)
        s = self.settings_for(seed, iteration)
        x, z = rollout_noise(latent_shape, self.num_steps, seed, iteration, sample_ids, shared_group_size)
        x, z = x.to(device) * model.initial_scale(float(s.sigmas[0])), z.to(device)
        embeds, null, sig = embeds.to(device), s.negative.to(device), s.sigmas.to(device)
        latents, log_probs, means, previous, ode = [x], [], [], None, get_ode_solver(s.ode_solver)
        record = record_uncond and uses_cfg(model, s.guidance_scale)
        uncond = torch.empty((x.shape[0], self.num_steps, *x.shape[1:]), device=device) if record else None
        for t in range(self.num_steps):
            sigma = sig[t].expand(x.shape[0])
            if record:  # copied out: a view would keep the whole 2B output of every step alive
                v_cond, v_uncond = cfg_branches(model, x, sigma, embeds, null)
                v = combine(model, v_cond, v_uncond, s.guidance_scale)
                uncond[:, t] = v_uncond
            else:
                v = guided_velocity(model, x, sigma, embeds, null, s.guidance_scale)
            kw = dict(sigma_after_one=sig[1], noise=z[:, t])
            if s.after_window(t):
                out = ode(self.step, x, v, sig[t], sig[t + 1], previous, **kw)
            else:
                out = self.step(x, v, sig[t], sig[t + 1], noise_level=s.noise_level_at([t]), **kw)
            previous, x = (x, v, sig[t]), out.prev_sample
            latents.append(x)
            log_probs.append(out.log_prob)
            if record_means:
                means.append(out.mean.float())
        traj = Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), s, embeds, codec.decode(x),
                          list(prompts), group_ids.clone(), torch.as_tensor(sample_ids), uncond)
        traj.means = torch.stack(means, 1) if record_means else None
        traj.sources = None if embeds.images is None else decode_conditions(codec, embeds.images)
        return traj

    def rollout(self, model, codec, prompts: EncodedSet, prompt_idx: list[int], *, latent_shape: tuple[int, ...],
                seed: int, iteration: int, device, sample_offset: int = 0,
                on_batch: Callable[[Trajectory], None] | None = None, record_uncond: bool = False,
                record_means: bool = False) -> Trajectory:
        """``cfg.group_size`` samples for each prompt in ``prompt_idx`` (indices into ``prompts``), in
        batches of ``cfg.batch_size``. Sample ``p * group_size + g`` (plus ``sample_offset``, a rank's
        share start) is the global index that seeds its noise; its group id is ``p``.
        ``on_batch(batch_trajectory)`` is called, in batch order, as soon as each batch is decoded (e.g.
        to submit its reward scoring while the next batch samples). Raises ``ValueError`` when
        ``shared_initial_noise`` is set and ``sample_offset`` is not on a group boundary."""
        group_size, batch_size = self.cfg.group_size, self.cfg.batch_size
        shared = group_size if self.cfg.shared_initial_noise else None
        if shared and sample_offset % group_size:
            raise ValueError(f"rollout: sample_offset {sample_offset} is not on a group boundary "
                             f"(group_size {group_size}): shared initial noise would straddle groups")
        n, out = len(prompt_idx) * group_size, []
        for start in range(0, n, batch_size):
            ids = list(range(start, min(n, start + batch_size)))
            groups = [i // group_size for i in ids]
            _, embeds, captions = prompts.batch([prompt_idx[g] for g in groups])
            out.append(self.sample(model, codec, embeds, captions, group_ids=torch.as_tensor(groups),
                                   sample_ids=[sample_offset + i for i in ids], latent_shape=latent_shape, seed=seed,
                                   iteration=iteration, device=device, shared_group_size=shared,
                                   record_uncond=record_uncond, record_means=record_means))
            if on_batch is not None:
                on_batch(out[-1])
        return Trajectory.cat(out)


def log_prob(branches, traj: Trajectory, transitions: int | list[int]):
    """Recompute transition(s) ``transitions`` of ``traj``: the step (of the type the trajectory
    records) whose ``prev_sample`` is the recorded next latent, so ``log_prob`` is comparable with
    ``traj.log_probs[:, t]``. Returns the step type's result (:class:`rollout.sde.SDEStep`: ``log_prob``
    float32 ``[k * B]``, ``mean``, ``std_dev_t``).

    ``branches``: a model (:class:`pretrain.backbone.Backbone`, its CFG branches computed by a default
    :class:`rollout.branches.CFGBranches`) or a ``CFGBranches`` configured by the caller.
    ``transitions``: one index (rows = the B samples) or a list of k (one forward over k * B rows,
    ordered transition-major: row j * B + i is sample i at transition t[j]). ``ValueError`` when the
    trajectory records experts (Wan2.2 A14B) and the model would route one of ``transitions`` to
    another."""
    ts = [transitions] if isinstance(transitions, int) else list(transitions)
    s = traj.settings
    if isinstance(branches, torch.nn.Module):
        branches = CFGBranches(branches)
    if s.experts is not None:
        routed = branches.model.experts(s.sigmas[ts])
        if routed is None or routed.tolist() != [s.experts[t] for t in ts]:
            raise ValueError(f"log_prob: the rollout took transitions {ts} with experts {[s.experts[t] for t in ts]}, "
                             f"the model would use {None if routed is None else routed.tolist()}")
    dev = traj.latents.device
    sig, idx, b = s.sigmas.to(dev), torch.as_tensor(ts, device=dev), len(traj)
    rows = (len(ts) * b, *traj.latents.shape[2:])

    def transition_major(buf: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:  # [B, T, ...] -> [k * B, ...]
        return lambda i: buf[:, i].transpose(0, 1).reshape(rows)

    latents = transition_major(traj.latents)
    x, prev = latents(idx), latents(idx + 1)
    sigma, sigma_next = sig[idx].repeat_interleave(b), sig[idx + 1].repeat_interleave(b)
    embeds = traj.embeds if len(ts) == 1 else PromptEmbeds.cat([traj.embeds] * len(ts))
    recorded = None if traj.uncond_velocities is None else (lambda: transition_major(traj.uncond_velocities)(idx))
    negative = s.negative.to(dev) if uses_cfg(branches.model, s.guidance_scale) else None
    v_cond, v_uncond = branches(x, sigma, embeds, negative, recorded)
    v = v_cond if v_uncond is None else combine(branches.model, v_cond, v_uncond, s.guidance_scale)
    return get_step(s.step)(x, v, sigma, sigma_next, noise_level=s.noise_level_at(ts), sigma_after_one=sig[1],
                            prev_sample=prev)
