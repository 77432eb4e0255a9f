"""The rollout's random draws, keyed by global sample index (never by rank or batch layout)."""

from __future__ import annotations

import torch

from pretrain.seeding import generator_for


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
