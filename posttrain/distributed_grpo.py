"""GRPO over N ranks (``torchrun --nproc_per_node N -m posttrain grpo CONFIG``): what a rank owns.

Every rank draws the same prompt list (seeded sampler), samples its contiguous share of the prompt
groups (``shard_bounds`` over the data-parallel ranks) with noise keyed by the *global* sample index,
scores it, and all-gathers rewards and group ids over the data-parallel group, so advantages are
computed on exactly the tensors one process would have; each rank then trains on its own slice.
Sequence-parallel ranks of one data-parallel group sample the same prompts and noise.

The policy (and, for full fine-tuning, the frozen reference) is FSDP2-sharded by
:func:`pretrain.parallel.fsdp.parallelize`; every forward is a collective, so every rank runs the
rollout, the update, the grids and the export gather, while only rank 0 logs and writes files.

Loss normalisation. Each rank's mini-batch loss is the mean over its *own* valid samples and FSDP2
averages gradients over the ``dp`` ranks, i.e. (1/dp) * sum_r S_r / c_r. The single-process
gradient of the union is sum_r S_r / sum_r c_r: both agree when every rank's mini-batch has as many
valid samples (always with finite rewards and ``grpo.drop_zero_spread_groups: false``). With NaN
rewards or dropped groups they differ (the per-rank-mean rule is what accelerate-based Flow-GRPO
does on several GPUs); see ``README.md`` (Distributed).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.config import ConfigError
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.data import gather_samples, shard_bounds
from pretrain.parallel.dims import Mesh
from pretrain.parallel.export import unsharded_copy
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import init_distributed


@dataclass
class RankLayout:
    """This process's place in the job: ``mesh`` is None in a single process (then every method is the
    identity / a plain call). ``start`` / ``stop``: this rank's prompt range of the current iteration."""

    mesh: Mesh | None
    device: torch.device
    start: int = 0
    stop: int = 0

    @classmethod
    def start_job(cls, parallel: ParallelConfig) -> RankLayout:
        """Join the ``torchrun`` process group if there is one (no-op in one process) and build the mesh
        when the world size is above 1. Raises ``ValueError`` naming the degrees when they do not
        multiply to the world size (from :meth:`ParallelDims.resolved`). Ranks other than 0 log warnings only."""
        device = init_distributed()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1 and dist.get_rank() != 0:  # one copy of every info line (rank 0's)
            logging.getLogger().setLevel(logging.WARNING)
        return cls(parallel.dims().build_mesh(device.type) if world > 1 else None, device)

    # -- who am I --------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size if self.mesh else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank if self.mesh else 0

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the only rank that logs and writes files)."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def describe(self) -> str:
        if not self.mesh:
            return "ranks: 1 process"
        d = self.mesh.dims
        return (f"ranks: world {dist.get_world_size()} = dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} "
                f"x sp {d.sp}; each data-parallel rank samples 1/{d.dp} of the prompt groups and trains "
                f"mini-batches of train.batch_size/{d.dp}; FSDP2 over the policy: perf.merge_lora off")

    # -- setup -----------------------------------------------------------------------------------
    def check(self, prompts_per_step: int, batch_size: int, ema_decay: float) -> None:
        """``ConfigError`` naming the key unless the data-parallel degree divides the prompts per step
        and the training mini-batch; EMA (``train.ema_decay`` > 0) is single-process only for now."""
        dp = self.dp_size
        if self.mesh and ema_decay > 0:
            raise ConfigError(f"train.ema_decay={ema_decay}: EMA of an FSDP2-sharded policy is not supported "
                              f"yet; use 0 with more than one rank")
        if prompts_per_step % dp:
            raise ConfigError(f"rollout.prompts_per_step={prompts_per_step} must be divisible by the {dp} "
                              f"data-parallel ranks (whole prompt groups are spread over ranks)")
        if batch_size % dp:
            raise ConfigError(f"train.batch_size={batch_size} must be divisible by the {dp} data-parallel "
                              f"ranks (each trains batch_size/{dp} samples of every mini-batch)")

    def shard(self, model: torch.nn.Module, reference: torch.nn.Module | None, parallel: ParallelConfig,
              compile_blocks: bool) -> None:
        """Ulysses SP (``parallel.sp`` > 1), then FSDP2 on ``model`` (peft adapters already added) and on
        the frozen full-fine-tuning ``reference`` if any. ``compile_blocks`` (``perf.compile``) joins
        ``parallel.compile``: one per-block compile, in torchtitan's order. No-op in one process."""
        if not self.mesh:
            return
        if self.mesh.sp_size > 1:
            from pretrain.parallel.sequence import enable_sequence_parallel

            for m in (model, reference):
                if m is not None:
                    enable_sequence_parallel(m, self.mesh.sp_group)
        pcfg = replace(parallel, compile=parallel.compile or compile_blocks)
        parallelize(model, self.mesh, pcfg)
        if reference is not None:
            parallelize(reference, self.mesh, pcfg)

    # -- one iteration ---------------------------------------------------------------------------
    def prompt_share(self, prompt_idx: list[int], group_size: int) -> tuple[list[int], int]:
        """This rank's contiguous share of ``prompt_idx`` (the same list on every rank) and the global
        index of its first sample (``sample_offset`` of ``collect_rollouts``); sets ``start``/``stop``."""
        self.start, self.stop = shard_bounds(len(prompt_idx), self.dp_rank, self.dp_size)
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

    def local(self, t: torch.Tensor, group_size: int) -> torch.Tensor:
        """This rank's samples of a gathered per-sample tensor ``[n * dp, ...]``."""
        return t[self.start * group_size:self.stop * group_size]

    # -- outputs ---------------------------------------------------------------------------------
    def grid(self, st, model: torch.nn.Module, eval_cfg, seed: int, shift: float, name: str) -> Path:
        """``st.grid`` on every rank (the sharded forwards are collectives); only rank 0's file is kept
        (other ranks write into a temporary folder). Returns rank 0's path."""
        if self.is_main:
            return st.grid(model, eval_cfg, seed, shift, name)
        with tempfile.TemporaryDirectory() as d:
            replace(st, run=Path(d)).grid(model, eval_cfg, seed, shift, name)
        return st.run / "samples" / name

    def export(self, st, final: torch.nn.Module) -> Path:
        """``st.finish`` (``lora/`` + merged ``export/``) of ``final``; when sharded, from a rank-0
        unsharded copy (collective), other ranks wait. Returns the export folder on every rank."""
        if not self.mesh:
            return st.finish(final)
        plain = unsharded_copy(final)
        out = st.finish(plain) if plain is not None else st.run / "export"
        dist.barrier()
        return out
