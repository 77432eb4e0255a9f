"""Config of the parallel layout (``parallel:`` block of a run config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.config import require_positive
from pretrain.parallel.dims import ParallelDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelConfig:
    """Degrees (``dp_shard: -1`` = all ranks left after ``dp_replicate``, ``cp``, ``sp`` and ``tp``;
    ``tp`` > 1: tensor parallelism with the model family's plan, ``tensor.py``), FSDP2 mixed
    precision (``param_dtype``: the dtype blocks compute in after the all-gather; ``reduce_dtype``: the
    dtype gradients are reduced in, fp32 by default as torchtitan), per-block activation checkpointing and
    per-block ``torch.compile``. With LoRA, ``param_dtype`` is the storage dtype of the frozen base and the
    adapters stay fp32 (``fsdp.py``). ``sp`` > 1 turns on Ulysses sequence parallelism with the model
    family's plan (``sequence.py``). ``ep`` > 1: expert parallelism for a mixture-of-experts denoiser
    (HiDream), ``ep`` data-parallel ranks each holding ``1 / ep`` of every layer's routed experts (``expert.py``).
    ``always_shard``: build the mesh and FSDP2-shard even when ``torchrun`` starts a single rank (a GPU
    check of the sharded code path on one device); without it one rank runs as a plain process.
    ``collective_timeout_s``: seconds a collective may wait before the process group aborts (a hang
    ends as an error, with an NCCL flight-recorder dump on GPUs: docs/doctor.md)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    always_shard: bool = False
    collective_timeout_s: float = 1800.0

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "dp_replicate", "sp", "tp", "cp", "ep", "collective_timeout_s")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"{prefix}dp_shard: must be >= 1 or -1 (infer), got {self.dp_shard}")
        try:
            self.dims().check()
        except ValueError as e:
            raise ValueError(str(e).replace("parallel.", prefix)) from None
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{prefix}{name}: '{getattr(self, name)}' is not one of {', '.join(DTYPES)}")
        if self.ep > 1 and self.reduce_dtype == "fp16":  # FSDP2 splits its divide factor for fp16 reductions,
            raise ValueError(f"{prefix}reduce_dtype: 'fp16' with {prefix}ep={self.ep} is not supported (the routed "
                             f"experts' gradients would be divided twice on one rank); use fp32 or bf16")

    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp_replicate, self.dp_shard, self.sp, self.tp, self.cp, self.ep)

    def compile_blocker(self) -> str | None:
        """Why per-block ``torch.compile`` cannot run under this layout (``tp`` > 1: the TP plans' own
        collectives, Wan's sharded q/k norm and FLUX's gathered ``proj_out`` input, do not trace yet), or None."""
        if self.tp > 1:
            return (f"parallel.tp={self.tp}: the TP plans' own collectives (Wan's sharded q/k norm, FLUX's "
                    f"gathered proj_out input) do not trace under torch.compile yet")
        return None

    def untested_compile(self) -> str | None:
        """Why a ``perf`` preset leaves per-block compile off under this layout: :meth:`compile_blocker`'s
        reason, or ``sp`` / ``cp`` / ``ep`` > 1 (their all-to-alls inside attention or the experts' dispatch have
        no test under compile; an explicit ``compile: true`` still runs there), or None."""
        blocker = self.compile_blocker()
        if blocker:
            return blocker
        wide = [f"parallel.{k}={getattr(self, k)}" for k in ("sp", "cp", "ep") if getattr(self, k) > 1]
        return f"{', '.join(wide)}: not tested under torch.compile" if wide else None
