"""Do data-parallel replicas still hold the same weights? Ranks that hold the same part of the model
(every rank in plain data parallelism, the ``dp_replicate`` ranks of one shard under HSDP) must stay
bitwise equal; a silent data corruption or a rank that stepped alone makes them drift apart, and the
next checkpoint keeps only one copy. :func:`check_replicas` names the ranks that differ.

The checksum of a parameter is two int64 sums over its local values reinterpreted as integers (the
values and their squares, wrapping on overflow): computed on the device, exact (integer sums do not
depend on the reduction order), and any single changed value changes it. It is a checksum, not a
cryptographic hash.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def param_checksums(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(parameter names, int64 ``[P, 2]`` CPU tensor of this rank's local-shard checksums)."""
    names, sums = [], []
    for name, p in model.named_parameters():
        x = _local(p).detach().contiguous()
        xi = x.view(_INT[x.element_size()]).to(torch.int64).flatten()
        names.append(name)
        sums.append(torch.stack([xi.sum(), (xi * xi).sum()]))
    return names, (torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.int64))


def shard_key(model: torch.nn.Module) -> tuple[int, ...]:
    """This rank's coordinates on the mesh dimensions any of its parameters is sharded over, in order of
    first appearance (``()`` when none is sharded): ranks with equal keys hold the same part of the
    model and must be equal. Every parameter counts, since under TP x FSDP the parameters live on
    different meshes (FSDP's 1-D ``dp_shard_sp``, the TP layers' 2-D ``(dp_shard_sp, tp)``)."""
    coords: dict[str, int] = {}
    for p in model.parameters():
        if not hasattr(p, "placements"):
            continue
        mesh = p.device_mesh
        coord = mesh.get_coordinate() or []
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        for name, c, pl in zip(names, coord, p.placements):
            if pl.is_shard():
                coords.setdefault(name, c)
    return tuple(coords.values())


def compare(records: list[tuple[int, tuple, list[str], torch.Tensor]]) -> list[str]:
    """Descriptions of replicas that differ, from every rank's ``(rank, shard key, names, checksums)``:
    within each group of equal keys, a rank outside the majority checksum is named with the number of
    parameters that differ and the first one; without a strict majority every differing rank is named."""
    groups: dict[tuple, list] = {}
    for rec in records:
        groups.setdefault(tuple(rec[1]), []).append(rec)
    out = []
    for key, recs in groups.items():
        if len(recs) < 2:
            continue
        sigs = {r[0]: r[3].numpy().tobytes() for r in recs}
        count = Counter(sigs.values())
        top, n = count.most_common(1)[0]
        if len(count) == 1:
            continue
        majority = n > len(recs) / 2
        ref = next(r for r in recs if sigs[r[0]] == top)
        where = f" (shard {list(key)})" if key else ""
        for rank, _, names, sums in recs:
            if majority and sigs[rank] == top:
                continue
            diff = (sums != ref[3]).any(dim=1).nonzero().flatten().tolist() if rank != ref[0] else []
            if not diff:  # no majority: compare with the first other rank that differs
                other = next(r for r in recs if sigs[r[0]] != sigs[rank])
                diff = (sums != other[3]).any(dim=1).nonzero().flatten().tolist()
            others = sorted(r[0] for r in recs if r[0] != rank)
            out.append(f"rank {rank}{where} differs from its replicas (ranks {others}"
                       f"{', the majority' if majority else ''}) in {len(diff)} parameter(s), first {names[diff[0]]}")
    return out


def check_replicas(model: torch.nn.Module) -> list[str]:
    """Compare the parameters of data-parallel replicas across all ranks (collective; ``[]`` in one
    process). Returns one description per rank that differs (see :func:`compare`), the same on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    names, sums = param_checksums(model)
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (dist.get_rank(), shard_key(model), names, sums))
    return compare(records)
