"""SDE rollout with log-probs (Flow-GRPO) under rank-free seeding."""

from __future__ import annotations

import torch

from pretrain.seeding import generator_for
from pretrain.text_encoder import PromptEmbeds
from pretrain.flow import cfg_combine
from pretrain.guidance import guided_branches, guided_velocity
from rollout.sde import sde_step
from rollout.trajectory import Trajectory


def rollout_noise(shape: tuple[int, ...], num_steps: int, seed: int, step: int, sample_ids: list[int],
                  shared_group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise ``[B, *shape]`` and per-transition noise ``[B, T, *shape]`` (float32, CPU): sample
    i's draws come from the generator (seed, "rollout", step, sample_ids[i]) only, so they do not
    depend on batch layout or rank.

    ``shared_group_size`` = G: samples ``i`` with the same ``sample_ids[i] // G`` (one prompt group)
    start from the same initial noise, drawn from (seed, "rollout", step, sample_ids[i] // G, "init"), as
    DanceGRPO does (Xue et al. 2025, arXiv 2505.07818): the group's rewards then differ only through
    the SDE's per-transition noise, the part of the trajectory the log-probs credit."""
    init, steps, shared = [], [], {}
    for i in sample_ids:
        g = generator_for(seed, "rollout", step, int(i))
        init.append(torch.randn(shape, generator=g))  # drawn even when shared: the steps' draws stay the same
        steps.append(torch.randn((num_steps, *shape), generator=g))
        if shared_group_size:
            key = int(i) // shared_group_size
            if key not in shared:  # one draw per group in this batch
                shared[key] = torch.randn(shape, generator=generator_for(seed, "rollout", step, key, "init"))
            init[-1] = shared[key]
    return torch.stack(init), torch.stack(steps)


@torch.no_grad()
def sde_rollout(model, codec, embeds: PromptEmbeds, null_embeds: PromptEmbeds, prompts: list[str],
                group_ids: torch.Tensor, sample_ids: list[int], sigmas: torch.Tensor, noise_level: float,
                guidance_scale: float, latent_shape: tuple[int, ...], seed: int, step: int,
                device: torch.device, shared_group_size: int | None = None, record_uncond: bool = False) -> Trajectory:
    """Sample one batch with the SDE and record every latent and log-prob.

    ``model``: a :class:`pretrain.backbone.Backbone`; ``sigmas``: its ``model.sigmas(...)``. The first
    state is the unit noise times ``model.initial_scale(sigmas[0])``; ``shared_group_size``: see
    :func:`rollout_noise`. ``record_uncond``: keep the unconditional branch's velocities
    (``Trajectory.uncond_velocities``, with CFG only) so that training before the first optimizer step
    reuses them instead of recomputing them (``perf.reuse_rollout_uncond``)."""
    num_steps = len(sigmas) - 1
    x, z = rollout_noise(latent_shape, num_steps, seed, step, sample_ids, shared_group_size)
    x, z = x.to(device) * model.initial_scale(float(sigmas[0])), z.to(device)
    embeds = embeds.to(device)
    null = null_embeds.to(device)
    sig = sigmas.to(device)
    latents, log_probs = [x], []
    record = record_uncond and guidance_scale != 1.0
    uncond = torch.empty((x.shape[0], num_steps, *x.shape[1:]), device=device) if record else None
    for t in range(num_steps):
        s = sig[t].expand(x.shape[0])
        if record:  # copied out: a view would keep the whole 2B output of every step alive
            v_cond, v_uncond = guided_branches(model, x, s, embeds, null)
            v = cfg_combine(v_cond, v_uncond, guidance_scale)
            uncond[:, t] = v_uncond
        else:
            v = guided_velocity(model, x, s, embeds, null, guidance_scale)
        out = sde_step(x, v, sig[t], sig[t + 1], noise_level, sig[1], noise=z[:, t])
        x = out.prev_sample
        latents.append(x)
        log_probs.append(out.log_prob)
    images = codec.decode(x)
    return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas.cpu().clone(), embeds,
                      images, list(prompts), group_ids.clone(), torch.as_tensor(sample_ids),
                      uncond)
