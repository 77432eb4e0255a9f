"""Weight sync from the trainer to rollout workers: a versioned packet of the policy's trainable tensors
(the LoRA adapters only, or every weight for full fine-tuning) with a SHA-256 checksum over names,
dtypes, shapes and bytes, checked on arrival. The packet travels through Ray's object store
(:meth:`posttrain.engines.ray_pool.WorkerPool.publish`: put once, read by every worker)."""

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
