"""The training runtime every trainer uses: one optimizer step with accumulation, clipping, mixed
precision, the numerics guard (agreed by all ranks), loss-spike detection, the replica check, EMA,
LR schedule, full-state checkpoints (DCP) and the record of torchrun restarts.

A trainer computes float32 losses under ``runtime.autocast()``, calls ``runtime.backward(loss)``
per micro-batch and ``runtime.optimizer_step(loss_value)`` once per step; ``save()`` / ``resume()``
cover model, optimizer, LR schedule, EMA, grad scaler, guard counters, every RNG state and any
extra ``stateful`` objects (data or prompt-sampler positions).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pretrain.runtime.adam_eps import EpsMonitor
from pretrain.runtime.checkpoint import (WORLD, CheckpointError, CheckpointManager, own_rank, per_rank, rng_state,
                                         set_rng_state)
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.ema import build_ema
from pretrain.parallel.replicas import check_replicas
from pretrain.runtime import faults
from pretrain.runtime.guard import NonFiniteGuard, RunStopped
from pretrain.runtime.low_precision import after_optimizer_step, fp8_all_gather_modules
from pretrain.runtime.optim import build_lr_scheduler, build_optimizer
from pretrain.runtime.precision import Precision
from pretrain.runtime.restarts import Attempt, restart_count
from pretrain.runtime.spikes import SpikeDetector
from pretrain.parallel.grad_norm import clip_grad_norm_

log = logging.getLogger(__name__)


class ReplicaDriftError(RunStopped):
    """Data-parallel replicas hold different weights (the message names the ranks and a parameter)."""


def _world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Runtime:
    """Optimisation state of one trainable ``model`` (its ``requires_grad`` parameters).

    ``total_steps``: optimizer steps of the whole run for the LR schedule (default ``cfg.steps``;
    trainers whose ``steps`` count iterations pass it explicitly). ``shape``: ``{dotted config key:
    value}`` recorded with every checkpoint; resuming with a different value is refused
    (``ConfigError`` naming the key and both values). The world size and the learning-rate settings
    (restored with the optimizer and schedule state, so a new value would be ignored) are always part
    of it. ``unit``: (name, optimizer steps per unit) of the stage's log, e.g. ``("iteration", 4)``
    for GRPO, so that a stop message names the step as the rest of the run's log counts it."""

    def __init__(self, model: torch.nn.Module, cfg: RuntimeConfig, optim: OptimConfig, device: torch.device,
                 checkpoint_dir: str | Path, keep_last: int = 2, stateful: dict[str, Stateful] | None = None,
                 total_steps: int | None = None, shape: dict | None = None, unit: tuple[str, int] = ("step", 1)):
        self.model, self.cfg, self.optim_cfg, self.device = model, cfg, optim, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, optim)
        self.scheduler = build_lr_scheduler(self.optimizer, total_steps or cfg.steps, optim)
        self.precision = Precision(cfg.precision, device)
        self.ema = build_ema(model, cfg.ema_decay)
        self.unit = unit
        self.guard = NonFiniteGuard(cfg.max_nonfinite, self.step_label,
                                    "steps" if unit == ("step", 1) else "optimizer steps", self.resume_hint)
        self.spikes = SpikeDetector(cfg.spike_window, cfg.spike_zscore)
        self.spikes_total = 0
        self.checkpoints = CheckpointManager(checkpoint_dir, keep_last)
        self.attempt = Attempt(Path(checkpoint_dir).parent, _world()[0])
        self.fp8_all_gather = fp8_all_gather_modules(model)  # converted before the runtime is built
        self.stateful = dict(stateful or {})
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # the optimizer and LR-schedule state a resume loads carry these: a changed value would be ignored.
        # The world size is recorded, not checked: a resume on another number of data-parallel ranks reshards.
        self.shape = {"optim.lr": optim.lr, "optim.schedule": optim.schedule, "optim.warmup_steps": optim.warmup_steps,
                      "optim.min_lr_ratio": optim.min_lr_ratio, **(shape or {})}
        self.step = 0
        self.amp_overflows = 0
        self.eps_monitor = EpsMonitor(optim.eps_check_every)

    # -- one optimizer step -------------------------------------------------------------------
    def autocast(self):
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's float32 scalar loss, divided by ``grad_accum`` here."""
        loss = loss / self.cfg.grad_accum
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def optimizer_step(self, loss_value: float, buckets: dict[str, tuple[float, int]] | None = None) -> dict:
        """Clip, check, step (or skip), update EMA and LR. ``loss_value`` is this rank's mean loss of the
        step; ``buckets``: optional ``{name: (loss sum, sample count)}`` of this rank's share (the same
        names on every rank, e.g. :func:`pretrain.runtime.spikes.sigma_buckets`), judged by the spike
        detector as global means.

        Every rank decides alike: the loss and gradient norm of all ranks are gathered first, a
        non-finite value on any rank skips the step on every rank (the metric names the ranks), and the
        spike detector sees the means over ranks. Every ``train.replica_check_every`` steps the
        data-parallel replicas are compared (:func:`pretrain.parallel.replicas.check_replicas`).

        Returns metrics: grad_norm, lr, skipped (0/1), nonfinite (name of the bad quantity and, with
        several ranks, where; or ""), nonfinite_total, amp_overflows, spike (0/1), spikes_total, and at
        step 1 and every ``optim.eps_check_every`` steps adam_eps_dominated_frac
        (:mod:`pretrain.runtime.adam_eps`; warned about once above 0.5). Raises
        ``NonFiniteError`` after too many bad steps in a row, ``ReplicaDriftError`` when replicas differ."""
        scaler, opt, step = self.precision.scaler, self.optimizer, self.step + 1
        loss_value = faults.inject(step, loss_value, self.params)
        if scaler is not None:
            scaler.unscale_(opt)
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(clip_grad_norm_(self.params, max_norm))
        bad_ranks, means = self._across_ranks(loss_value, grad_norm, buckets or {})
        loss_ok, grad_ok = not bad_ranks["loss"], not bad_ranks["grad_norm"]
        overflow = scaler is not None and loss_ok and not grad_ok
        bad = None if overflow else self.guard.check(
            step, **{self._where(name, bad_ranks[name]): means[name] if not bad_ranks[name] else float("nan")
                     for name in ("loss", "grad_norm")})
        spikes = self.spikes.check(means) if bad is None and not overflow else []
        if spikes:
            self.spikes_total += 1
            log.warning("step %d: loss spike: %s (z-score over the last %d steps; train.spike_action=%s)", step,
                        ", ".join(f"{n} = {v:.4g} (z {z:.1f})" for n, v, z in spikes), self.spikes.window,
                        self.cfg.spike_action)
        skip_spike = bool(spikes) and self.cfg.spike_action == "skip"
        lr = opt.param_groups[0]["lr"]
        if overflow:  # fp16: the scaler skips this step and lowers its scale
            self.amp_overflows += 1
            scaler.step(opt)
            scaler.update()
        elif bad is not None or skip_spike:
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update()
        else:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            after_optimizer_step(self.fp8_all_gather)
            if self.ema is not None:
                self.ema.update()
        opt.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step = step
        self.attempt.progress(step)
        every = self.cfg.replica_check_every
        if every and step % every == 0 and (drift := check_replicas(self.model)):
            raise ReplicaDriftError(f"step {step}: data-parallel replicas hold different weights: " + "; ".join(drift)
                                    + f". Stopping; the latest checkpoint is {self.checkpoints.latest()} (check the "
                                    f"named ranks' hardware, e.g. with posttrain doctor, before resuming)")
        return {"grad_norm": grad_norm, "lr": lr, "skipped": int(overflow or bad is not None or skip_spike),
                "nonfinite": bad or "", "nonfinite_total": self.guard.total, "amp_overflows": self.amp_overflows,
                "spike": int(bool(spikes)), "spikes_total": self.spikes_total, **self.eps_monitor(opt, step)}

    def _across_ranks(self, loss_value: float, grad_norm: float, buckets: dict[str, tuple[float, int]]
                      ) -> tuple[dict[str, list[int]], dict[str, float]]:
        """({"loss": ranks with a non-finite loss, "grad_norm": ... }, the values every rank judges: the
        loss and gradient norm averaged over ranks, each bucket's summed loss over its summed count, NaN
        for an empty bucket). One all-gather of a few float64 numbers; no collective in one process."""
        local = [loss_value, grad_norm, *(x for total, n in buckets.values() for x in (total, float(n)))]
        rank, world = _world()
        rows = [local]
        if world > 1:
            t = torch.tensor(local, dtype=torch.float64, device=self.device)
            parts = [torch.empty_like(t) for _ in range(world)]
            torch.distributed.all_gather(parts, t)
            rows = [p.tolist() for p in parts]
        bad = {name: [r for r, row in enumerate(rows) if not math.isfinite(row[i])]
               for i, name in enumerate(("loss", "grad_norm"))}
        means = {"loss": sum(row[0] for row in rows) / world, "grad_norm": sum(row[1] for row in rows) / world}
        for i, name in enumerate(buckets):
            total, n = sum(row[2 + 2 * i] for row in rows), sum(row[3 + 2 * i] for row in rows)
            means[name] = total / n if n else float("nan")
        return bad, means

    @staticmethod
    def _where(name: str, ranks: list[int]) -> str:
        if not ranks or _world()[1] == 1:
            return name
        return f"{name} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    def step_label(self, step: int) -> str:
        """Optimizer step ``step`` as the stage's log names it: ``step 7``, or ``iteration 4 (optimizer
        step 7)`` when a unit holds several optimizer steps."""
        name, per = self.unit
        if (name, per) == ("step", 1):
            return f"step {step}"
        return f"{name} {(step - 1) // per + 1} (optimizer step {step})"

    def resume_hint(self) -> str:
        """What ``--resume`` would continue from, named (never called intact unchecked)."""
        latest = self.checkpoints.latest()
        if latest is None:
            return "no checkpoint was written yet, so there is nothing to resume (rerun to start over)"
        return (f"--resume continues from {latest}, the newest checkpoint (written from finite weights and "
                f"optimizer state, and checked again on resume)")

    @contextmanager
    def sampling_model(self):
        """``with runtime.sampling_model() as model:`` the model with the weights to sample and export
        with: the EMA's swapped in when ``train.ema_decay`` > 0 (:meth:`EMA.swapped`; the trained
        weights come back when the block ends), else the trained weights."""
        if self.ema is None:
            yield self.model
            return
        try:
            with self.ema.swapped():
                after_optimizer_step(self.fp8_all_gather)  # FP8 all-gather scales of the weights swapped in
                yield self.model
        finally:
            after_optimizer_step(self.fp8_all_gather)  # and of the trained weights, back

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, saved_world: int | None = None) -> dict:
        """The checkpointed state. Model, optimizer, EMA and the ``stateful`` objects with
        ``sharded_state`` (DTensors, e.g. an old policy's shards) are resharded by DCP; RNG states and the
        other ``stateful`` objects are per rank (:func:`per_rank`; ``saved_world``: as a template to load a
        checkpoint written by that many processes, whose rank 0 entry every rank then reads)."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        sharded = {k for k, v in self.stateful.items() if getattr(v, "sharded_state", False)}
        state = {"model": msd, "optim": osd, "scheduler": self.scheduler.state_dict(), "step": self.step,
                 "guard": self.guard.state_dict(), "amp_overflows": self.amp_overflows,
                 "spikes": {"history": self.spikes.state_dict(), "total": self.spikes_total},
                 # per rank: DCP keeps one copy of equal keys, and each rank has its own RNG and positions
                 "rng": per_rank(rng_state(), saved_world),
                 "stateful": per_rank({k: v.state_dict() for k, v in self.stateful.items() if k not in sharded},
                                      saved_world)}
        if sharded:
            state["sharded"] = {k: self.stateful[k].state_dict() for k in sharded}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler.state_dict()
        return state

    def unhealthy(self) -> str | None:
        """Why the current state must not be checkpointed (or resumed from), or None: the last step(s)
        were non-finite and skipped (the weights produce non-finite losses), a trainable parameter (or
        its EMA) holds a non-finite value, or the optimizer state (moments, learning rates) or the LR
        schedule's state does (each named). Collective under a process group: every rank gets the same
        answer."""
        reason = None
        if self.guard.consecutive:
            reason = f"the last {self.guard.consecutive} step(s) were non-finite and skipped"
        else:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            if self.ema is not None:
                named += [(f"ema.{n}", t) for n, t in self.ema.named_tensors()]
            bad = next((n for n, p in named if not _finite(p)), None)
            reason = f"parameter {bad} holds non-finite values" if bad is not None else self._bad_optim_state()
        if torch.distributed.is_initialized():
            flags = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(flags, reason)
            reason = next((r for r in flags if r), None)
        return reason

    def _bad_optim_state(self) -> str | None:
        """The first non-finite entry of the optimizer state (per-parameter moments, each group's
        learning rate) or of the LR schedule's state, as a phrase naming it; None when all are finite."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, entries in self.optimizer.state.items():
            bad = next((k for k, v in entries.items() if not _finite(v)), None)
            if bad is not None:
                return f"optimizer state {bad} of parameter {names.get(id(p), '?')} holds non-finite values"
        bad = next((f"optimizer param group {i} {k}" for i, group in enumerate(self.optimizer.param_groups)
                    for k in ("lr", "initial_lr") if not _finite(group.get(k, 0.0))), None)
        if bad is None:
            bad = _first_nonfinite(self.scheduler.state_dict(), "LR schedule state ")
        return None if bad is None else f"{bad} is not finite"

    def save(self, step: int | None = None) -> Path | None:
        """Checkpoint the state as ``step_<step>`` (default: the optimizer step count). A checkpoint is
        never written from weights :meth:`unhealthy` rejects: the save is skipped with a warning (the
        previous checkpoint stays the latest) and None is returned."""
        step = self.step if step is None else step
        reason = self.unhealthy()
        if reason:
            log.warning("checkpoint step_%d not written: %s; the latest checkpoint stays %s", step, reason,
                        self.checkpoints.latest())
            return None
        path = self.checkpoints.save(step, self.state_dict(), {WORLD: self.world, **self.shape})
        self.attempt.progress(self.step, checkpoint=step)
        return path

    def load(self, path: str | Path) -> None:
        written = self.checkpoints.written_world(path)
        if written != self.world:
            log.warning("resuming on %d process(es) from %s, written by %d: model, optimizer%s resharded by DCP "
                        "(the global batch and the sample stream by global index are kept); RNG states and data "
                        "positions from rank 0", self.world, path, written,
                        ", EMA" if self.ema is not None else "")
        state = self.state_dict(written)
        if not self.checkpoints.holds(path, "spikes"):  # written before the spike detector: it starts empty
            state.pop("spikes")
        if "sharded" in state and not self.checkpoints.holds(path, "sharded"):  # written before: kept per rank
            state["stateful"] = per_rank({k: v.state_dict() for k, v in self.stateful.items()}, written)
            state.pop("sharded")
        self.checkpoints.load(state, path)
        # frozen parameters (a LoRA base) are not in the checkpoint: they come from the export
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.guard.load_state_dict(state["guard"])
        self.amp_overflows = int(state["amp_overflows"])
        spikes = state.get("spikes", {"history": {}, "total": 0})
        self.spikes.load_state_dict(spikes["history"])
        self.spikes_total = int(spikes["total"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        if self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(state["scaler"])
        saved = {**own_rank(state["stateful"], written), **state.get("sharded", {})}
        for k, v in self.stateful.items():
            if k in saved:
                v.load_state_dict(saved[k])
            elif not getattr(v, "state_optional", False):  # e.g. a rollout engine's queue: empty when absent
                raise KeyError(f"the checkpoint holds no state for '{k}' (it has {sorted(saved)})")
        set_rng_state(own_rank(state["rng"], written))

    def start(self, resume: bool) -> Path | None:
        """Begin a run: with ``resume``, load the latest complete checkpoint (None if there is none);
        without it, refuse a checkpoint folder that already holds checkpoints (``ValueError``), so two
        runs never mix in one directory. A rank that torchrun restarted (:mod:`pretrain.runtime.restarts`)
        always resumes, records the restart and its reasons, and raises ``RunStopped`` when the previous
        attempt stopped on purpose (a guard's stop is not undone by restarting)."""
        if restart_count() > 0:
            stop = self.attempt.previous_stop()
            if stop:
                raise RunStopped(f"torchrun restart {restart_count()}: the previous attempt stopped on purpose "
                                 f"({stop}); not training again")
            resume = True
        if resume:
            path = self.resume()
            if path is None:
                log.warning("nothing to resume in %s: starting from step 0", self.checkpoints.root)
            summary = self.attempt.begin(self.step, path)
            if summary:
                log.warning(summary)
            return path
        if self.checkpoints.steps():
            raise ValueError(f"{self.checkpoints.root} already holds checkpoints {self.checkpoints.steps()}: pass "
                             f"--resume (checkpoint.resume=true) to continue that run, or use another run_dir")
        self.attempt.begin(0, None)
        return None

    def resume(self) -> Path | None:
        """Load the newest intact checkpoint if there is one; returns its path (None: no checkpoint).

        A checkpoint is intact when it matches its manifest (:meth:`CheckpointManager.verify`), loads,
        and holds finite weights, optimizer and LR-schedule state (:meth:`unhealthy`); one that is not is reported by path with the reason (a warning) and
        the previous one is tried. Raises ``ConfigError`` (naming the key and both values) when the
        newest checkpoint was written by a run of another shape, and :class:`CheckpointError` naming
        every checkpoint tried when none is intact."""
        tried = []
        for path in self.checkpoints.candidates():
            self.checkpoints.check_shape(path, self.shape)
            reason = self.checkpoints.verify(path)
            if reason is None:
                try:
                    self.load(path)
                except Exception as e:  # DCP's CheckpointException, a size mismatch, a pickle error, ...
                    reason = f"does not load: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            if reason is None:
                reason = self.unhealthy()
            if reason is None:
                if tried:
                    log.warning("resumed from %s, the newest intact checkpoint (skipped: %s)", path,
                                "; ".join(tried))
                return path
            log.warning("checkpoint %s is not usable: %s; trying the previous one", path, reason)
            tried.append(f"{path}: {reason}")
        if tried:
            raise CheckpointError(f"no intact checkpoint to resume from in {self.checkpoints.root} ("
                                  + "; ".join(tried) + "); start a new run_dir or restore a copy")
        return None


def _finite(value) -> bool:
    """Whether a tensor (this rank's shard of a DTensor) or a number holds only finite values; anything
    else (an integer tensor, None, a string) counts as finite."""
    if torch.is_tensor(value):
        value = getattr(value, "_local_tensor", value)
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    return not isinstance(value, float) or math.isfinite(value)


def _first_nonfinite(tree, prefix: str) -> str | None:
    """The dotted path (after ``prefix``) of the first non-finite number or tensor in a nest of dicts,
    lists and tuples, or None."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return None if _finite(tree) else prefix.rstrip(". ")
    for key, value in items:
        bad = _first_nonfinite(value, f"{prefix}{key}.")
        if bad is not None:
            return bad
    return None
