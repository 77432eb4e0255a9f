"""GRPO over N ranks (``torchrun --nproc_per_node N -m posttrain grpo CONFIG``): what a rank owns.

Every rank draws the same prompt list (seeded sampler), samples its contiguous share of the prompt
groups (``shard_bounds`` over the data-parallel ranks) with noise keyed by the *global* sample index,
scores it, and all-gathers rewards and group ids over the data-parallel group, so advantages are
computed on exactly the tensors one process would have; each rank then trains on its own slice.
Sequence-parallel ranks of one data-parallel group sample the same prompts and noise.

The policy (and, for full fine-tuning, the frozen reference) is FSDP2-sharded by
:func:`pretrain.parallel.fsdp.parallelize`; every forward is a collective, so every rank runs the
rollout, the update, the grids and the export gather, while only rank 0 logs and writes files.

Loss normalisation. FSDP2 averages gradients over the ``dp`` ranks, (1/dp) * sum_r S_r / c_r for
per-rank sums S_r over c_r valid samples, while one process would take sum_r S_r / sum_r c_r:
:class:`posttrain.grpo.update.GRPOUpdate` rescales each rank's loss by dp * c_r / sum_r c_r (given
the dp group), so both agree whatever NaN rewards or dropped groups leave on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.base.stage import StageRanks
from pretrain.parallel.data import gather_samples


@dataclass
class RankLayout(StageRanks):
    """GRPO's view of the job (:class:`pretrain.parallel.job.JobRanks`: mesh, device, sharding, outputs)
    plus ``start`` / ``stop``: this rank's prompt range of the current iteration."""

    start: int = 0
    stop: int = 0

    def describe(self) -> str:
        if not self.mesh:
            return "ranks: 1 process"
        dp = self.mesh.dims.dp
        return (f"ranks: {self.layout()}; each data-parallel rank samples 1/{dp} of the prompt groups and trains "
                f"mini-batches of train.batch_size/{dp}; FSDP2{' and tensor parallelism' if self.mesh.tp_size > 1 else ''} "
                f"over the policy: perf.merge_lora off")

    # -- setup -----------------------------------------------------------------------------------
    def check(self, prompts_per_step: int, batch_size: int) -> None:
        """``ConfigError`` naming the key unless the data-parallel degree divides the prompts per step
        and the training mini-batch."""
        self.require_divisible("rollout.prompts_per_step", prompts_per_step,
                               "whole prompt groups are spread over ranks")
        self.require_divisible("train.batch_size", batch_size,
                               f"each trains batch_size/{self.dp_size} samples of every mini-batch")

    # -- one iteration ---------------------------------------------------------------------------
    def prompt_share(self, prompt_idx: list[int], group_size: int) -> tuple[list[int], int]:
        """This rank's contiguous share of ``prompt_idx`` (the same list on every rank) and the global
        index of its first sample (``sample_offset`` of :meth:`rollout.sampler.Sampler.rollout`); sets
        ``start``/``stop``."""
        self.start, self.stop = self.share(len(prompt_idx))
        return prompt_idx[self.start:self.stop], self.start * group_size

    def gather(self, total: torch.Tensor, raw: dict[str, torch.Tensor], group_ids: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """All-gather this rank's ``total`` float ``[n]``, each ``raw[name]`` float ``[n]`` and local
        ``group_ids`` long ``[n]`` (offset here by ``start``) over the data-parallel group, in rank
        order = single-process order: returns ``[n * dp]`` CPU tensors (NaN kept)."""
        group_ids = group_ids + self.start
        if not self.mesh:
            return total, raw, group_ids

        def cat(t: torch.Tensor) -> torch.Tensor:  # NCCL gathers device tensors only
            return gather_samples(t.to(self.device), self.mesh.dp_group).cpu()

        return cat(total), {k: cat(v) for k, v in raw.items()}, cat(group_ids)

    def sum_counts(self, counts: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """``{name: (a, b)}`` integer pairs summed over the data-parallel group (the same names, in the
        same order, on every rank); unchanged in one process."""
        if not self.mesh or not counts:
            return counts
        t = torch.tensor([list(v) for v in counts.values()], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(t, group=self.mesh.dp_group)
        return {k: (int(a), int(b)) for k, (a, b) in zip(counts, t.tolist())}

    def local(self, t: torch.Tensor, group_size: int) -> torch.Tensor:
        """This rank's samples of a gathered per-sample tensor ``[n * dp, ...]``."""
        return t[self.start * group_size:self.stop * group_size]


def equal_chunks(transitions: list[int], per: int) -> list[tuple[list[int], bool]]:
    """The chunks of ``per`` transitions one mini-batch's forwards take, ``(chunk, real)``, padded so that
    every rank makes the same number of forwards: under FSDP2 each forward all-gathers the sharded
    blocks, so a rank with fewer chunks (a selection or window that differs by rank) would leave the
    others waiting in a collective, or pair mismatched ones. A padding chunk (``real`` False) repeats
    this rank's last chunk; the caller weights its loss by 0 (its backward still joins the
    reduce-scatters) and keeps nothing of it. Without a process group: no padding. ``ValueError`` on
    every rank when some rank has no transition while another has some (nothing to repeat)."""
    chunks = [(transitions[c:c + per], True) for c in range(0, len(transitions), per)]
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return chunks
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    n = torch.tensor([len(chunks), -len(chunks)], dtype=torch.long, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    most, fewest = int(n[0]), -int(n[1])
    if fewest == 0 and most > 0:
        raise ValueError(f"a rank has no transition to train while another has {most} chunk(s): the selection "
                         f"must give every rank at least one")
    return chunks + [(chunks[-1][0], False)] * (most - len(chunks))


def global_count_weight(mask: torch.Tensor, dp_group) -> float:
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
