"""Parallel degrees and the one named ``DeviceMesh`` built from them (torchtitan's ``ParallelDims``,
``torchtitan/distributed/parallel_dims.py``).

The mesh is always 5-D, ``("dp_replicate", "dp_shard", "cp", "sp", "tp")`` (size-1 dimensions
included), made by unflattening one 1-D world mesh from ``init_device_mesh`` (torchtitan's current
recipe), which also gives other views of the same ranks:

- ``"dp"`` = dp_replicate x dp_shard: the data-parallel ranks. Each holds different samples; the data
  loader / prompt sampler splits by ``dp_rank`` of ``dp_size``.
- ``"dp_shard_sp"`` = dp_shard x cp x sp: the ranks FSDP2 shards parameters over (HSDP replicates over
  ``"dp_replicate"``). Context- and sequence-parallel ranks share their samples, so their gradients are
  summed, not averaged (see ``fsdp.py``).
- ``"tp"``: the tensor-parallel ranks (``tensor.py``); they share their samples and hold different
  slices of the sharded layers. FSDP2 shards those DTensors further over ``"dp_shard_sp"`` (2-D).
- ``"ep"`` (``ep`` > 1, a view of ``dp_shard``, the innermost ``ep`` ranks of it): the expert-parallel
  ranks; each holds different samples and different routed experts (``expert.py``), which FSDP2 shards over
  ``"dp_shard_mod_ep"``, the ranks holding the same experts.

TP ranks are the innermost dimension (a TP group is a block of consecutive ranks: one node's fast links),
then SP, then CP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass
class ParallelDims:
    """Degrees of data replication (HSDP outer dim), data sharding (FSDP), context parallelism (diffusers'
    plans, ``context.py``), sequence parallelism (our Ulysses plans, ``sequence.py``) and tensor
    parallelism (``tensor.py``).

    ``dp_shard=-1`` takes whatever the world size leaves after the other degrees. :meth:`resolved` (called
    by ``build_mesh``) raises ``ValueError`` naming every degree and the world size when their product
    differs from it, when a degree is below 1, or naming both keys for a combination that is not
    supported (two of ``sp``, ``cp``, ``tp`` above 1: each splits the attention heads its own way;
    ``ep`` > 1 with any of them or with ``dp_replicate`` > 1: not composed yet), or when ``ep`` does not
    divide ``dp_shard`` (EP ranks are data-parallel ranks)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def check(self) -> None:
        """The checks that need no world size: every degree but ``dp_shard`` >= 1, and the combinations of
        the class docstring (``ValueError`` naming the keys)."""
        for name in ("dp_replicate", "cp", "sp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
        for a, b in (("sp", "tp"), ("sp", "cp"), ("cp", "tp")):
            if getattr(self, a) > 1 and getattr(self, b) > 1:
                raise ValueError(f"parallel.{a}={getattr(self, a)} with parallel.{b}={getattr(self, b)}: these two "
                                 f"do not compose yet (both split the attention heads); use one of them")
        if self.ep > 1:
            wide = [f"parallel.{k}={getattr(self, k)}" for k in ("dp_replicate", "cp", "sp", "tp")
                    if getattr(self, k) > 1]
            if wide:
                raise ValueError(f"parallel.ep={self.ep} with {', '.join(wide)}: expert parallelism composes with "
                                 f"FSDP (dp_shard) only so far")

    def resolved(self, world_size: int) -> ParallelDims:
        """A copy with ``dp_shard=-1`` replaced by world_size / (dp_replicate * cp * sp * tp), validated."""
        dims = ParallelDims(self.dp_replicate, self.dp_shard, self.sp, self.tp, self.cp, self.ep)
        dims.check()
        others = dims.dp_replicate * dims.cp * dims.sp * dims.tp
        named = f"dp_replicate={dims.dp_replicate} x cp={dims.cp} x sp={dims.sp} x tp={dims.tp}"
        if dims.dp_shard == -1:
            if world_size % others:
                raise ValueError(f"parallel: {named} = {others} does not divide the world size {world_size}, "
                                 f"so dp_shard=-1 cannot be inferred")
            dims.dp_shard = world_size // others
        if dims.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard: must be >= 1 or -1 (infer), got {dims.dp_shard}")
        if dims.dp_shard * others != world_size:
            raise ValueError(f"parallel: dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x cp={dims.cp} x "
                             f"sp={dims.sp} x tp={dims.tp} = {dims.dp_shard * others} != world size {world_size}")
        if dims.dp_shard % dims.ep:
            raise ValueError(f"parallel.ep={dims.ep} does not divide dp_shard={dims.dp_shard} (EP ranks are "
                             f"data-parallel ranks)")
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree (number of distinct sample shards)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str = "cpu") -> Mesh:
        """Validate against the initialised process group's world size and build the mesh (every rank
        must call this, in the same order relative to other collectives)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        dims = self.resolved(world)
        flat = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
        inner = dims.cp * dims.sp * dims.tp
        return Mesh(
            dims,
            device_mesh=flat._unflatten(0, (dims.dp_replicate, dims.dp_shard, dims.cp, dims.sp, dims.tp), MESH_DIMS),
            dp_mesh=flat._unflatten(0, (dims.dp, inner), ("dp", "cp_sp_tp"))["dp"],
            shard_mesh=flat._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp * dims.sp, dims.tp),
                                       ("dp_replicate", "dp_shard_sp", "tp")),
            cp_mesh=flat._unflatten(0, (dims.dp, 1, dims.cp, dims.sp * dims.tp),
                                    ("dp", "ring", "ulysses", "sp_tp"))["ring", "ulysses"],
            expert_mesh=flat._unflatten(0, (dims.dp_shard // dims.ep, dims.ep), ("dp_shard_mod_ep", "ep"))
            if dims.ep > 1 else None,
        )


@dataclass
class Mesh:
    """A validated ``ParallelDims`` with its named ``DeviceMesh`` (``mesh["sp"]`` slices it), the 1-D
    data-parallel view ``dp_mesh``, the 3-D (dp_replicate, dp_shard_sp, tp) ``shard_mesh`` and the 2-D
    ("ring", "ulysses") ``cp_mesh`` of the CP ranks that diffusers' context parallelism takes (ring 1), and
    with ``ep`` > 1 the 2-D (``dp_shard_mod_ep``, ``ep``) ``expert_mesh`` (None otherwise)."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    shard_mesh: DeviceMesh
    cp_mesh: DeviceMesh
    expert_mesh: DeviceMesh | None = None

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        return self.device_mesh[names]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dims.dp`` data shards (SP ranks of one group share it)."""
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def sp_rank(self) -> int:
        return self.device_mesh["sp"].get_local_rank()

    @property
    def sp_size(self) -> int:
        return self.dims.sp

    @property
    def sp_group(self) -> torch.distributed.ProcessGroup:
        """The process group of this rank's SP ranks (Ulysses all-to-alls run over it)."""
        return self.device_mesh["sp"].get_group()

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    def tp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's TP ranks (the one ``parallelize_module`` takes; sliced from the
        same root as :meth:`fsdp_mesh`, as FSDP2 requires of a 2-D TP x FSDP layout)."""
        return self.shard_mesh["tp"]

    @property
    def dp_group(self) -> torch.distributed.ProcessGroup:
        """The process group of the data-parallel ranks sharing this rank's CP, SP and TP index (reward
        gathers)."""
        return self.dp_mesh.get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes: 1-D ``dp_shard_sp`` (FSDP), or 2-D (``dp_replicate``,
        ``dp_shard_sp``) for HSDP (replicate over the first dimension, shard over the second)."""
        if self.dims.dp_replicate > 1:
            return self.shard_mesh["dp_replicate", "dp_shard_sp"]
        return self.shard_mesh["dp_shard_sp"]
