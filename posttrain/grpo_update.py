"""The GRPO policy update over one rollout buffer: per-transition PPO-clip + beta * KL, several inner
epochs of shuffled mini-batches, optimizer steps through the shared runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.losses import kl_to_reference, ppo_clip_loss
from posttrain.perf import PerfConfig, records_uncond
from pretrain.seeding import generator_for
from pretrain.text_encoder import PromptEmbeds
from pretrain.guidance import guided_velocity
from rollout.sde import sde_step
from rollout.trajectory import Trajectory


@dataclass
class GRPOLossConfig:
    """``clip_range``: PPO clip on the per-element-mean log-prob ratio; ``beta``: weight of the KL to
    the reference (Flow-GRPO form); ``adv_clip_max``: advantage clip; ``inner_epochs``: passes over
    the buffer per iteration; ``drop_zero_spread_groups``: mask groups whose rewards are all equal;
    ``detach_uncond``: no gradient through the unconditional CFG branch (default; set false for
    flow_grpo's behaviour, gradients through both branches). The loss value is the same either way.
    ``reward_aggregation``: "sum" (weighted sum of rewards, then group advantages) or "advantages"
    (group advantages per reward, then their weighted sum, as DanceGRPO does for several rewards)."""

    clip_range: float = 1e-3
    beta: float = 0.04
    adv_clip_max: float = 5.0
    inner_epochs: int = 1
    drop_zero_spread_groups: bool = False
    detach_uncond: bool = True
    reward_aggregation: str = "sum"

    def validate(self, prefix: str = "") -> None:
        if self.reward_aggregation not in ("sum", "advantages"):
            raise ValueError(f"{prefix}reward_aggregation: '{self.reward_aggregation}' is not one of sum, advantages")
        if self.inner_epochs < 1:
            raise ValueError(f"{prefix}inner_epochs: must be >= 1")


def transition_log_prob(model, traj: Trajectory, t: int | list[int], null: PromptEmbeds, guidance_scale: float,
                        noise_level: float, detach_uncond: bool = True, uncond_model=None,
                        uncond_in_batch: bool = False, rollout_uncond: bool = False):
    """Recompute transition(s) ``t`` of ``traj`` under ``model``: the ``SDEStep`` whose ``prev_sample``
    is the recorded next latent (so ``log_prob`` is comparable with ``traj.log_probs[:, t]``).

    ``t``: one transition (rows = the B samples) or a list of k (one forward over k * B rows, ordered
    transition-major: row j * B + i is sample i at transition t[j]). ``uncond_model`` /
    ``uncond_in_batch``: see :func:`pretrain.guidance.guided_branches`. ``rollout_uncond``: take the
    unconditional branch from ``traj.uncond_velocities`` (valid only while the weights are the
    rollout's) instead of a forward."""
    ts = [t] if isinstance(t, int) else list(t)
    dev = traj.latents.device
    sig, idx, b = traj.sigmas.to(dev), torch.as_tensor(ts, device=dev), len(traj)
    rows = (len(ts) * b, *traj.latents.shape[2:])

    def transition_major(buf: torch.Tensor, i: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [k * B, ...]
        return buf[:, i].transpose(0, 1).reshape(rows)

    x, prev = transition_major(traj.latents, idx), transition_major(traj.latents, idx + 1)
    sigma, sigma_next = sig[idx].repeat_interleave(b), sig[idx + 1].repeat_interleave(b)
    embeds = traj.embeds if len(ts) == 1 else PromptEmbeds.cat([traj.embeds] * len(ts))
    v_uncond = transition_major(traj.uncond_velocities, idx) if rollout_uncond else None
    v = guided_velocity(model, x, sigma, embeds, null, guidance_scale, detach_uncond, uncond_model, uncond_in_batch,
                        v_uncond)
    return sde_step(x, v, sigma, sigma_next, noise_level, sig[1], prev_sample=prev)


def transition_loss(policy, traj: Trajectory, t: int | list[int], advantages: torch.Tensor, mask: torch.Tensor,
                    null: PromptEmbeds, cfg: GRPOLossConfig, guidance_scale: float, noise_level: float,
                    uncond_model=None, uncond_in_batch: bool = False, rollout_uncond: bool = False):
    """PPO-clip + beta * KL of a mini-batch, averaged over transition(s) ``t`` (one or a list, computed in
    one forward); returns (float32 loss, stats). The mean over k transitions in one call equals the mean
    of k single-transition losses. ``uncond_model`` computes the detached unconditional branch
    (default: the policy itself); ``rollout_uncond``: see :func:`transition_log_prob`."""
    ts = [t] if isinstance(t, int) else list(t)
    k = len(ts)
    st = transition_log_prob(policy.model, traj, ts, null, guidance_scale, noise_level, cfg.detach_uncond,
                             uncond_model, uncond_in_batch, rollout_uncond)
    old = traj.log_probs[:, ts].transpose(0, 1).reshape(-1)
    adv, mask = advantages.repeat(k), mask.repeat(k)
    loss, stats = ppo_clip_loss(st.log_prob, old, adv, cfg.clip_range, mask)
    if cfg.beta > 0:
        with torch.no_grad(), policy.reference() as ref:
            ref_mean = transition_log_prob(ref, traj, ts, null, guidance_scale, noise_level).mean
        kl = kl_to_reference(st.mean, ref_mean, st.std_dev_t)
        w = mask.float()
        kl = (kl * w).sum() / w.sum().clamp(min=1.0)
        loss = loss + cfg.beta * kl
        stats["kl"] = float(kl.detach())
    return loss, stats


def merge_stats(acc: dict, stats: dict, weight: float) -> None:
    """Fold one chunk of transitions' stats into ``acc``: min / max for ratio_min / ratio_max, a mean
    weighted by ``weight`` (the chunk's share of the transitions) otherwise."""
    for key, v in stats.items():
        if key == "ratio_min":
            acc[key] = min(acc.get(key, v), v)
        elif key == "ratio_max":
            acc[key] = max(acc.get(key, v), v)
        else:
            acc[key] = acc.get(key, 0.0) + v * weight


def grpo_update(policy, runtime, traj: Trajectory, advantages: torch.Tensor, mask: torch.Tensor,
                null: PromptEmbeds, cfg: GRPOLossConfig, timesteps: list[int], mini_batch_size: int,
                guidance_scale: float, noise_level: float, seed: int, iteration: int,
                perf: PerfConfig | None = None, dp_group=None) -> list[dict]:
    """Inner epochs over ``traj`` in mini-batches shuffled by (seed, "shuffle", iteration, epoch);
    ``runtime.cfg.grad_accum`` mini-batches per optimizer step. Returns per-mini-batch stats.
    ``perf``: speed options (:class:`posttrain.perf.PerfConfig`; same loss and gradients). Until the first
    optimizer step the unconditional CFG branch is read from ``traj.uncond_velocities`` when the rollout
    recorded them (the weights are still the rollout's); the first step sets them to None on ``traj``
    (they no longer hold; a second update over the same buffer recomputes), after which the branch is
    recomputed.
    ``dp_group``: the data-parallel process group when this rank trains its share of the samples; the
    loss is then rescaled by dp x (local valid count) / (global valid count), so that the gradient FSDP
    averages over ranks is the mean over all ranks' valid samples even when ranks mask different
    numbers of them (NaN rewards, dropped groups)."""
    perf = perf or PerfConfig()
    n = len(traj)
    accum = runtime.cfg.grad_accum
    out, pending = [], 0.0
    # until the first optimizer step the weights are the rollout's: its unconditional velocities hold
    reuse = traj.uncond_velocities is not None and records_uncond(perf, cfg.detach_uncond, guidance_scale)
    policy.model.train()
    for epoch in range(cfg.inner_epochs):
        perm = torch.randperm(n, generator=generator_for(seed, "shuffle", iteration, epoch))
        for k, start in enumerate(range(0, n, mini_batch_size)):
            idx = perm[start:start + mini_batch_size]
            mb = traj.select(idx)
            mb_stats: dict[str, float] = {}
            uncond = policy.inference_model(runtime.step) if perf.merge_lora else None
            weight = _global_count_weight(mask[idx], dp_group)
            per = perf.transitions_per_forward or len(timesteps)
            for c in range(0, len(timesteps), per):
                chunk = timesteps[c:c + per]
                share = len(chunk) / len(timesteps)
                with runtime.autocast():
                    loss, stats = transition_loss(policy, mb, chunk, advantages[idx], mask[idx], null, cfg,
                                                  guidance_scale, noise_level, uncond, perf.uncond_in_batch, reuse)
                runtime.backward(loss * share * weight)
                pending += loss.item() * share / accum
                merge_stats(mb_stats, stats, share)
            if (k + 1) % accum == 0:
                mb_stats.update(runtime.optimizer_step(pending))
                mb_stats["loss"] = pending
                pending, reuse = 0.0, False
                traj.uncond_velocities = None  # stale from here on; frees the buffer
            out.append(mb_stats)
    return out


def _global_count_weight(mask: torch.Tensor, dp_group) -> float:
    """dp x (valid samples here) / (valid samples over the group), 1 without a group or when no rank
    has a valid sample (then every loss is 0 anyway)."""
    if dp_group is None:
        return 1.0
    import torch.distributed as dist

    count = mask.float().sum().reshape(1)
    total = count.clone()
    dist.all_reduce(total, group=dp_group)
    if float(total) == 0.0:
        return 1.0
    return dist.get_world_size(dp_group) * float(count) / float(total)
