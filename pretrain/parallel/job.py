"""One training job over the ranks ``torchrun`` started: what every trainer's rank needs to know and do.

:class:`JobRanks` joins the process group (a no-op in one process), builds the mesh, refuses what
does not shard (EMA), gives this rank's contiguous share of a global batch (``shard_bounds`` over the
data-parallel ranks; sequence-parallel ranks of one group get the same share), averages logged
scalars over the data-parallel ranks, shards the model (Ulysses SP, TP, CP, then FSDP2), and runs the
collective outputs (grids, exports) on every rank while only rank 0 writes. In one process every
method is the identity or a plain call, so single-process runs are unchanged bit for bit.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from pretrain.config import ConfigError
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.data import shard_bounds
from pretrain.parallel.dims import Mesh
from pretrain.parallel.export import unsharded_copy
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import init_distributed

T = TypeVar("T")


@dataclass
class JobRanks:
    """This process's place in the job: ``mesh`` is None in a single process (world size 1)."""

    mesh: Mesh | None
    device: torch.device

    @classmethod
    def start_job(cls, parallel: ParallelConfig, dump_dir: str | Path | None = None, **fields):
        """Join the ``torchrun`` process group if there is one (collectives time out after
        ``parallel.collective_timeout_s``; NCCL flight-recorder dumps go to ``dump_dir``) and build the
        mesh when the world size is above 1 (or 1 with ``parallel.always_shard`` under ``torchrun``).
        Raises ``ValueError`` naming the degrees when they do not multiply to the world size.
        Ranks other than 0 log warnings only. ``fields``: a subclass's extra dataclass fields."""
        device = init_distributed(parallel.collective_timeout_s, dump_dir)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1 and dist.get_rank() != 0:  # one copy of every info line (rank 0's)
            logging.getLogger().setLevel(logging.WARNING)
        sharded = world > 1 or (parallel.always_shard and dist.is_initialized())
        return cls(parallel.dims().build_mesh(device.type) if sharded else None, device, **fields)

    @classmethod
    def start_batch_job(cls, parallel: ParallelConfig, batch_size: int, why: str,
                        dump_dir: str | Path | None = None):
        """:meth:`start_job`, then the checks of a trainer whose global micro-batch ``train.batch_size``
        is split over the data-parallel ranks (``why``: what one rank trains): :meth:`require_divisible` (``ConfigError`` naming the key)."""
        ranks = cls.start_job(parallel, dump_dir)
        ranks.require_divisible("train.batch_size", batch_size, why)
        return ranks

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

    def layout(self) -> str:
        """"world N = dp_replicate a x dp_shard b x sp c", or "1 process"."""
        if not self.mesh:
            return "1 process"
        d = self.mesh.dims
        extra = "".join(f" x {k} {getattr(d, k)}" for k in ("cp", "tp") if getattr(d, k) > 1)
        extra += f" (experts over ep {d.ep} of the dp_shard ranks)" if d.ep > 1 else ""
        return f"world {dist.get_world_size()} = dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x sp {d.sp}{extra}"

    def model_parallel_shape(self) -> dict:
        """``{"parallel.tp" | "parallel.sp" | "parallel.cp" | "parallel.ep": degree}`` of this job (1 in one
        process): what a resume keeps (checked against the checkpoint's ``shape.json``), while the
        data-parallel degree may change."""
        d = self.mesh.dims if self.mesh else None
        return {f"parallel.{k}": getattr(d, k) if d else 1 for k in ("tp", "sp", "cp", "ep")}

    # -- config checks ---------------------------------------------------------------------------
    def require_divisible(self, key: str, value: int, why: str) -> None:
        """``ConfigError`` naming ``key`` unless the data-parallel degree divides ``value``."""
        if value % self.dp_size:
            raise ConfigError(f"{key}={value} must be divisible by the {self.dp_size} data-parallel ranks ({why})")

    # -- data ------------------------------------------------------------------------------------
    def share(self, n: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's contiguous share of a global batch of ``n`` samples
        (``(0, n)`` in one process; ``ValueError`` unless the data-parallel degree divides ``n``)."""
        return shard_bounds(n, self.dp_rank, self.dp_size)

    def mean(self, values: list[float]) -> list[float]:
        """Each of ``values`` averaged over the data-parallel ranks (all-reduce, float64); unchanged in one
        process. With equal shares, the mean of per-rank means is the mean over the global batch."""
        if not self.mesh or self.dp_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.mesh.dp_group)
        return (t / self.dp_size).tolist()

    def pool(self, metrics: dict, count: float, same: tuple[str, ...] = ()) -> dict:
        """This rank's ``metrics`` (numbers over its ``count`` samples) pooled over the data-parallel
        ranks, as if one process had computed them over every sample: keys ending in ``_max`` take the
        maximum over ranks, ``_min`` the minimum, every other number the count-weighted mean
        sum_r count_r * value_r / sum_r count_r (the pooled mean, right under uneven splits, where a
        mean of per-rank means is not; the plain mean when no rank has a sample; NaN stays NaN). Keys
        in ``same`` (equal on every rank, e.g. the global gradient norm, the LR) and non-numbers are
        rank 0's; a key some ranks lack is pooled over the ranks that have it. One
        ``all_gather_object`` of a small dict; unchanged in one process."""
        if not self.mesh or self.dp_size == 1:
            return dict(metrics)
        rows: list = [None] * self.dp_size
        dist.all_gather_object(rows, (float(count), metrics), group=self.mesh.dp_group)
        out = dict(rows[0][1])
        for key, value in metrics.items():
            if key in same or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            have = [(c, m[key]) for c, m in rows if isinstance(m.get(key), (int, float))]
            vals = [float(v) for _, v in have]
            if any(math.isnan(v) for v in vals):
                out[key] = float("nan")
            elif key.endswith("_max"):
                out[key] = max(vals)
            elif key.endswith("_min"):
                out[key] = min(vals)
            else:
                total = sum(c for c, _ in have)
                out[key] = (sum(c * v for c, v in have) / total) if total > 0 else sum(vals) / len(vals)
        return out

    # -- setup -----------------------------------------------------------------------------------
    def shard(self, model: torch.nn.Module, reference: torch.nn.Module | None, parallel: ParallelConfig,
              compile_blocks: bool = False, low_precision=None) -> None:
        """Prepare ``model`` (peft adapters already added) and a frozen full-fine-tuning ``reference`` if
        any, in torchtitan's order: the ``low_precision`` conversion of their denoisers (a
        :class:`~pretrain.runtime.low_precision.LowPrecisionConfig`; also in one process), then Ulysses SP
        (``parallel.sp`` > 1), then tensor / context parallelism (``parallel.tp`` / ``parallel.cp`` > 1) and
        FSDP2 (:func:`parallelize`). ``compile_blocks`` joins ``parallel.compile``: one per-block
        compile. Sharding is a no-op in one process. ``ConfigError`` naming both keys for low precision
        with ``parallel.tp`` > 1, and for compile with ``parallel.tp`` > 1."""
        if low_precision is not None and low_precision.enabled:
            from pretrain.runtime.low_precision import convert

            if self.mesh and self.mesh.tp_size > 1:
                raise ConfigError(f"train.low_precision.recipe={low_precision.recipe} with parallel.tp="
                                  f"{self.mesh.tp_size}: the converted layers' low-precision weights and "
                                  f"scales are not wired through the tensor-parallel plans; use one of them")

            for m in (model, reference):
                if m is not None:
                    convert(m.transformer, low_precision)
        if not self.mesh:
            return
        if self.mesh.sp_size > 1:
            from pretrain.parallel.sequence import enable_sequence_parallel

            for m in (model, reference):
                if m is not None:
                    enable_sequence_parallel(m, self.mesh.sp_group)
        pcfg = replace(parallel, compile=parallel.compile or compile_blocks)
        blocker = replace(parallel, tp=self.mesh.tp_size).compile_blocker()
        if pcfg.compile and blocker:
            raise ConfigError(f"parallel.compile / perf.compile with {blocker}; turn compile off")
        parallelize(model, self.mesh, pcfg)
        if reference is not None:
            parallelize(reference, self.mesh, pcfg)

    # -- outputs ---------------------------------------------------------------------------------
    def write_on_main(self, write: Callable[[Path], Path], root: Path) -> Path:
        """``write(root)`` on rank 0; on other ranks ``write`` runs into a temporary folder that is then
        deleted (a sharded model's forwards are collectives, so every rank must run them). Returns rank
        0's path (``write``'s result, re-rooted at ``root`` on other ranks)."""
        if self.is_main:
            return write(root)
        with tempfile.TemporaryDirectory() as d:
            out = write(Path(d))
            return root / out.relative_to(d)

    def export_on_main(self, write: Callable[[torch.nn.Module], T], model: torch.nn.Module, default: T) -> T:
        """``write(model)`` in one process; when sharded, ``write`` of a rank-0 unsharded CPU copy
        (collective gather) while other ranks wait at a barrier and return ``default``."""
        if not self.mesh:
            return write(model)
        plain = unsharded_copy(model)
        out = write(plain) if plain is not None else default
        dist.barrier()
        return out
