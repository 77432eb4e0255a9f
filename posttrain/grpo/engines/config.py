"""The ``engine:`` block of a GRPO config: which rollout engine samples, and the Ray workers' settings."""

from __future__ import annotations

from dataclasses import dataclass

#: the ``engine.mode`` names, from on-policy to the furthest ahead
MODES = ("sync", "one_step_off", "async")


@dataclass
class RolloutEngineConfig:
    """``engine`` (:mod:`posttrain.grpo.engines`). ``name``: ``local`` (every trainer rank samples its
    share, the default) or ``ray`` (``workers`` Ray actors with ``num_cpus`` / ``num_gpus`` each, in one
    placement group; ``ray_address`` or ``RAY_ADDRESS`` joins a running cluster, else a local one is
    started). ``mode``: ``sync`` (on-policy), ``one_step_off`` (iteration k + 1 samples while k trains)
    or ``async`` (up to ``max_staleness`` iterations ahead); the last two need ``name: ray``.
    ``weight_sync``: how a worker gets the weights after each update, ``object_store`` (a packet put in
    Ray's object store once, fetched with a worker's next request) or ``collective`` (broadcast in a
    gloo / NCCL process group of the trainer's rank 0 and the workers, when every worker is idle)."""

    name: str = "local"
    workers: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    mode: str = "sync"
    max_staleness: int = 2
    ray_address: str | None = None
    weight_sync: str = "object_store"

    def validate(self, prefix: str = "") -> None:
        """``ValueError`` naming the key for an unknown engine, mode or weight sync, a mode the engine
        cannot run, resources out of range, or Ray missing for ``name: ray``."""
        if self.name not in ("local", "ray"):
            raise ValueError(f"{prefix}name: '{self.name}' is not one of local, ray")
        if self.mode not in MODES:
            raise ValueError(f"{prefix}mode: '{self.mode}' is not one of {', '.join(MODES)}")
        if self.name == "ray":
            from pretrain.extras import require

            require("ray", f"{prefix}name: ray")
        if self.mode != "sync" and self.name != "ray":
            raise ValueError(f"{prefix}mode: '{self.mode}' samples while the trainer trains, which needs "
                             f"{prefix}name: ray (the local engine samples on the trainer's own ranks)")
        if self.weight_sync not in ("object_store", "collective"):
            raise ValueError(f"{prefix}weight_sync: '{self.weight_sync}' is not one of object_store, collective")
        check_actors(self, prefix, "workers")
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError(f"{prefix}max_staleness: must be >= 1 in async mode, got {self.max_staleness}")


def check_actors(cfg, prefix: str, count: str) -> None:
    """``ValueError`` naming the key when ``cfg.<count>`` (how many Ray actors) is below 1 or an actor's
    ``num_cpus`` / ``num_gpus`` is below 0."""
    if getattr(cfg, count) < 1:
        raise ValueError(f"{prefix}{count}: must be >= 1, got {getattr(cfg, count)}")
    for key in ("num_cpus", "num_gpus"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{prefix}{key}: must be >= 0, got {getattr(cfg, key)}")
