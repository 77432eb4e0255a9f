"""Weight sync from the trainer to rollout workers: a versioned packet of the policy's trainable tensors
(the LoRA adapters only, or every weight for full fine-tuning) with a SHA-256 checksum over names,
dtypes, shapes and bytes, checked on arrival. The packet travels through Ray's object store
(:meth:`posttrain.grpo.engines.ray_pool.WorkerPool.publish`: put once, read by every worker)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class WeightSyncError(RuntimeError):
    """A weight packet that does not match its checksum, or names a tensor the worker does not have."""


def clean_name(name: str) -> str:
    """A parameter name without the wrappers compile / activation checkpointing / FSDP insert."""
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 over each tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def frozen_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` a packet does not carry (``requires_grad`` False: a LoRA policy's
    base weights), ``{clean name: tensor}`` as stored (not copied; unsharded models only): what a
    worker keeps from its own load of the export, which no sync may change."""
    return {clean_name(n): p.detach() for n, p in model.named_parameters() if not p.requires_grad}


@dataclass
class WeightPacket:
    """``version``: iterations trained when the weights were taken; ``kind``: ``lora`` (adapter tensors
    only) or ``full``; ``tensors``: ``{parameter name: CPU tensor}`` in the trainer's dtype;
    ``checksum``: :func:`checksum` of ``tensors`` at build time."""

    version: int
    kind: str
    tensors: dict[str, torch.Tensor]
    checksum: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @classmethod
    @torch.no_grad()
    def build(cls, model: torch.nn.Module, version: int, lora: bool) -> "WeightPacket":
        """The trainable parameters of ``model`` (LoRA: the adapters; full: every trainable weight),
        unsharded: under FSDP2 each DTensor's ``full_tensor()`` is a collective, so every rank calls
        this and all get the same packet."""
        tensors = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            tensors[clean_name(name)] = t.detach().cpu().clone()
        return cls(version, "lora" if lora else "full", tensors, checksum(tensors))

    def verify(self) -> None:
        """``WeightSyncError`` naming the version when the tensors do not match the checksum."""
        got = checksum(self.tensors)
        if got != self.checksum:
            raise WeightSyncError(f"weight packet version {self.version} ({self.kind}, {len(self.tensors)} tensors): "
                                  f"checksum {got[:12]} does not match the sender's {self.checksum[:12]}; the "
                                  f"weights were corrupted in transit and are not applied")

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> None:
        """Verify, then copy every tensor into ``model``'s parameter of the same name.
        ``WeightSyncError`` for a bad checksum or a name ``model`` lacks (nothing is copied then)."""
        self.verify()
        own = {clean_name(n): p for n, p in model.named_parameters()}
        missing = [n for n in self.tensors if n not in own]
        if missing:
            raise WeightSyncError(f"weight packet version {self.version}: {len(missing)} tensor(s) the worker's model "
                                  f"does not have, first {missing[0]!r}")
        for name, t in self.tensors.items():
            own[name].copy_(t.to(own[name].device, own[name].dtype))


class WeightGroup:
    """The collective path: the trainer's rank 0 (group rank 0) and the workers (ranks 1..W) in a
    process group of their own (``gloo`` on CPU, ``nccl`` on GPUs), rendezvous through a ``TCPStore``
    the trainer hosts; a push broadcasts every tensor from rank 0, the metadata and checksum travel
    beside it (:meth:`meta`) and each worker verifies the checksum before applying. ``generation``
    prefixes the store keys: the group is formed again, under a new generation, when a worker is
    replaced. Every member must call :meth:`broadcast` for the same packet at the same time."""

    def __init__(self, host: str, port: int, rank: int, world: int, backend: str, generation: int,
                 store=None, timeout_s: float = 300.0):
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.store = store if store is not None else dist.TCPStore(host, port, None, False, timeout)
        prefixed = dist.PrefixStore(f"weights/{generation}/", self.store)
        self.rank, self.backend = rank, backend
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @staticmethod
    def host_store(host: str, world: int, timeout_s: float = 300.0):
        """The trainer's ``TCPStore`` on a free port of ``host``: (store, port)."""
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        return store, store.port

    @staticmethod
    def meta(packet: WeightPacket) -> dict:
        """What travels beside the tensors: version, kind, checksum, and each tensor's name, shape, dtype."""
        return {"version": packet.version, "kind": packet.kind, "checksum": packet.checksum,
                "tensors": [(n, tuple(t.shape), t.dtype) for n, t in sorted(packet.tensors.items())]}

    def broadcast(self, packet: WeightPacket | None = None, meta: dict | None = None) -> WeightPacket:
        """Rank 0 sends ``packet``; the others receive into tensors laid out by ``meta`` and return the
        packet they got (call :meth:`WeightPacket.apply`, which checks the checksum)."""
        import torch.distributed as dist

        meta = meta if meta is not None else self.meta(packet)
        out = {}
        for name, shape, dtype in meta["tensors"]:
            t = (packet.tensors[name].to(self.device) if self.rank == 0
                 else torch.empty(shape, dtype=dtype, device=self.device))
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self.group.broadcast([t], opts).wait()
            out[name] = t.cpu()
        return WeightPacket(meta["version"], meta["kind"], out, meta["checksum"])
