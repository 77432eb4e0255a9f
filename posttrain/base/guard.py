"""Reward-hacking guard while a post-training stage runs.

Every ``guard.every`` steps the in-memory policy is probed on fixed held-out prompts and seeds (ODE
samples, :func:`posttrain.eval.probe.probe_scores`): the trained reward (the stage's own rewards, when
it has them), the guard rewards (any reward list, e.g. an independent judge model: higher is better)
and the held-out flow-matching loss of the export's objective (lower is better). The first check, at
step 0 before any update, is the baseline. A check **fails** when the trained reward is up on the
baseline while some guard is worse than its baseline by more than its threshold (relative to the
baseline's magnitude: reward hacking), when the trained reward has fallen by more than ``collapse_by`` while
some guard is worse by more than its threshold (the run is degrading: a collapse, where a hacking test
alone would pass every check), or when the within-group diversity of the rollouts since the previous check
(:func:`group_diversity`) is below ``min_diversity``. ``checks`` failing checks in a row stop the run
(``stop: true``): the stage ends early and exports, naming the guard and its values.

The best check is the one with the highest trained reward among those that do not fail (the baseline
included); its weights are kept in ``<stage>/guard/best.safetensors`` and exported with ``export: best``.
Why: a reward can be won by degenerate images (JPEG compressibility by blank ones); Flow-GRPO
(Liu et al. 2025, sec. 5) and DanceGRPO report such hacking, and the held-out loss and an independent
judge move when it happens.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from posttrain.eval.evaluate import parse_eval_reward
from posttrain.eval.probe import ProbeConfig, probe_scores, prompt_mean
from pretrain.sampling import save_grid
from rewards.base import build_reward

LOSS = "loss"


@dataclass
class GuardConfig:
    """``every``: steps between checks (0 = no guard). ``rewards``: guard rewards as eval entries
    (``NAME`` or ``NAME@PATH``, :func:`posttrain.eval.evaluate.parse_eval_reward`), higher is better;
    ``loss``: also watch the held-out flow-matching loss (lower is better). The probe: ``num_prompts``
    held-out prompts x ``samples_per_prompt`` seeds from ``seed``, ODE ``num_inference_steps`` at
    ``guidance_scale``; ``loss_samples`` held-out images for the loss. ``stop``: stop the stage after
    ``checks`` failing checks in a row; a guard fails when it is worse than its baseline by more than
    ``worse_by[name]`` (default ``default_worse_by``) times the baseline's magnitude, while the trained
    reward is up, or while it has fallen by more than ``collapse_by`` times its baseline's magnitude or
    become NaN (a collapse; 0 = hacking only); ``min_diversity``: the within-group diversity floor (RMS
    pixel distance in [0, 1],
    0 = off). ``export``: ``final`` (the last weights) or ``best`` (the best check's)."""

    every: int = 0
    rewards: list[str] = field(default_factory=list)
    loss: bool = True
    num_prompts: int = 16
    samples_per_prompt: int = 1
    seed: int = 0
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    loss_samples: int = 64
    stop: bool = False
    worse_by: dict[str, float] = field(default_factory=dict)
    default_worse_by: float = 0.1
    checks: int = 2
    collapse_by: float = 0.1
    min_diversity: float = 0.0
    export: str = "final"

    def validate(self, prefix: str = "") -> None:
        from pretrain.parallel.launch import launched_world_size

        if self.every < 0:
            raise ValueError(f"{prefix}every: must be >= 0 (0 = no guard), got {self.every}")
        if self.every and self.export == "best" and launched_world_size() > 1:
            raise ValueError(f"{prefix}export: 'best' keeps one process's unsharded weights; under torchrun use "
                             f"{prefix}export=final (the guard itself runs on every rank)")
        if self.export not in ("final", "best"):
            raise ValueError(f"{prefix}export: '{self.export}' is not one of final, best")
        if not self.every and (self.stop or self.export == "best"):
            raise ValueError(f"{prefix}every: stop / export: best need checks; set {prefix}every > 0")
        if self.every and not (self.rewards or self.loss or self.min_diversity > 0):
            raise ValueError(f"{prefix}rewards: nothing to watch (no reward, loss: false, min_diversity 0)")
        if self.checks < 1:
            raise ValueError(f"{prefix}checks: must be >= 1, got {self.checks}")
        for name in self.rewards:
            parse_eval_reward(name, f"{prefix}rewards")
        names = self.names()
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{prefix}rewards: {repeated} appear more than once (a guard is named by its reward; "
                             f"watch one model per reward name)")
        known = set(names)
        for name, value in {**self.worse_by, "default": self.default_worse_by}.items():
            if name != "default" and name not in known:
                raise ValueError(f"{prefix}worse_by: '{name}' is not a guard (known: {sorted(known)})")
            if not value > 0:
                raise ValueError(f"{prefix}worse_by: thresholds must be > 0, got {name}: {value}")
        if self.collapse_by < 0:
            raise ValueError(f"{prefix}collapse_by: must be >= 0 (0 = off), got {self.collapse_by}")
        if self.min_diversity < 0:
            raise ValueError(f"{prefix}min_diversity: must be >= 0, got {self.min_diversity}")
        ProbeConfig(self.num_prompts, self.samples_per_prompt, self.seed, self.num_inference_steps,
                    self.guidance_scale, self.loss_samples).validate(prefix)

    def names(self) -> list[str]:
        """The guards' names: each reward entry's name, and ``loss``."""
        return [parse_eval_reward(e)[0] for e in self.rewards] + ([LOSS] if self.loss else [])

    def probe_config(self) -> ProbeConfig:
        return ProbeConfig(num_prompts=self.num_prompts, samples_per_prompt=self.samples_per_prompt, seed=self.seed,
                           num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                           guard_samples=self.loss_samples if self.loss else 0)


def guard_shape(cfg: GuardConfig) -> dict:
    """The guard's part of a run's shape (what a resume must keep): whether it is on. Its state is part
    of the checkpoint when it is, and a run it stopped must not resume without it."""
    return {"guard.every": "on" if cfg.every else "off"}


def group_diversity(images: torch.Tensor, group_ids: torch.Tensor, max_side: int = 64) -> float:
    """Mean over prompt groups of the mean pairwise RMS distance between a group's images (float ``[N,
    3, H, W]`` or videos ``[N, F, 3, H, W]`` in [0, 1]; average-pooled to at most ``max_side`` px first):
    0 when every group's images are identical, 1 at most. Groups of one image are skipped; NaN when no
    group has two."""
    x = images.float()
    if x.ndim == 5:  # a clip's frames become channels: [N, F * 3, H, W]
        x = x.flatten(1, 2)
    side = max(x.shape[-2], x.shape[-1])
    if side > max_side:
        k = math.ceil(side / max_side)
        x = torch.nn.functional.avg_pool2d(x, k, ceil_mode=True)
    flat = x.flatten(1)
    values = []
    for g in torch.unique(group_ids):
        members = flat[group_ids == g]
        n = members.shape[0]
        if n < 2:
            continue
        dist = torch.cdist(members.double(), members.double()) / math.sqrt(members.shape[1])
        values.append(float(dist.sum() / (n * (n - 1))))
    return sum(values) / len(values) if values else float("nan")


class Guard:
    """The guard of one stage run (see the module docstring). ``stage``: its
    :class:`posttrain.base.stage.PolicyStage`; ``trained``: the stage's own reward
    (:class:`rewards.base.CompositeReward`, ``(images, prompts) -> (total float [N], raw)``; None: no
    trained reward, e.g. offline DPO or midtrain, and a guard then fails on its own).
    Checkpointed with the run (baseline, streak, best check), so a resumed run decides as the
    uninterrupted one would."""

    def __init__(self, cfg: GuardConfig, stage, trained: Callable | None):
        self.cfg, self.stage, self.trained = cfg, stage, trained
        self.fns = {}
        for entry in cfg.rewards:
            name, params = parse_eval_reward(entry)
            self.fns[name] = build_reward(name, **params)
        self.folder = stage.run / "guard"
        self.baseline: dict | None = None
        self.streak = 0
        self.best: dict | None = None  # {"step", "trained", values}
        self.diversity: list[float] = []  # since the previous check
        self.stopped: str | None = None

    @classmethod
    def for_stage(cls, cfg: GuardConfig, stage, trained: Callable | None) -> "Guard | None":
        """The guard of a stage run, or None when ``cfg.every`` is 0 (under torchrun the config was
        refused when it loaded: :meth:`GuardConfig.validate`)."""
        if not cfg.every:
            return None
        return cls(cfg, stage, trained)

    def start(self, model: torch.nn.Module, logger) -> None:
        """The baseline check at step 0, before any update (nothing when resumed: the baseline is in the
        checkpoint; a run the guard stopped says so and stays stopped); logged as step 0."""
        if self.stopped:
            logger.write(f"{self.stopped} (resumed: the run stays stopped; nothing more to train)")
        if self.baseline is None:
            metrics, _ = self.check(model, 0)
            logger.log(0, metrics, advance=False)
            logger.write(f"guard baseline: {describe(metrics)}")

    def at_step(self, model: torch.nn.Module, step: int, logger) -> tuple[dict, list[Path]]:
        """The check due at ``step`` (none: ``({}, [])``): its metrics and its probe's grid; logs the
        check and, when the run must stop, the reason."""
        if not self.due(step):
            return {}, []
        metrics, grid = self.check(model, step)
        logger.write(f"guard at step {step}: {describe(metrics)}")
        if self.stopped:
            logger.write(self.stopped)
        return metrics, [grid]

    def finish(self, model: torch.nn.Module, logger) -> None:
        """With ``export: best``, load the best check's weights into ``model`` (what the stage exports)."""
        if self.cfg.export == "best":
            logger.write(f"export: the guard's best check, step {self.load_best(model)}")

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def observe(self, diversity: float) -> None:
        """Record one step's within-group diversity (:func:`group_diversity`)."""
        if math.isfinite(diversity):
            self.diversity.append(diversity)

    def check(self, model: torch.nn.Module, step: int) -> tuple[dict, Path]:
        """Probe ``model`` at ``step`` (0 = the baseline). Returns (metrics ``guard/<name>`` (and
        ``guard/<name>/<category>``, :meth:`per_category`),
        ``guard/trained``, ``guard/diversity``, ``guard/failing``, ``guard/streak``, ``guard/best_step``,
        ``guard/seconds`` (the check's wall time); the grid of the probe's samples). Sets ``stopped`` (a
        one-line reason) when the run must stop."""
        t0 = time.perf_counter()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        fns = dict(self.fns)
        if self.trained is not None:
            fns["trained"] = lambda images, prompts, metadata=None: self.trained(images, prompts, metadata)[0]
        scores, loss, images, prompts, meta = probe_scores(model, self.stage, self.cfg.probe_config(), fns)
        values = {name: prompt_mean(scores[name]) for name in self.fns}
        if self.cfg.loss:
            values[LOSS] = loss
        trained = prompt_mean(scores["trained"]) if "trained" in scores else float("nan")
        diversity = _mean_over_ranks(self.diversity) if distributed else (
            sum(self.diversity) / len(self.diversity) if self.diversity else float("nan"))
        self.diversity = []
        reasons = []
        if self.baseline is None:
            self.baseline = {**values, "trained": trained}
        else:
            reasons = self.failures(values, trained, diversity)
        self.streak = self.streak + 1 if reasons else 0
        if not reasons and (self.best is None or not trained <= self.best["trained"]):  # NaN trained: latest wins
            self.best = {"step": step, "trained": trained, **values}
            if not distributed:  # under torchrun export: best is refused at config load; rank 0 keeps best.json
                self._save_best(model, self.best)
            elif torch.distributed.get_rank() == 0:
                self.folder.mkdir(parents=True, exist_ok=True)
                (self.folder / "best.json").write_text(json.dumps(self.best, indent=1) + "\n")
        if reasons and self.cfg.stop and self.streak >= self.cfg.checks:
            self.stopped = (f"guard stopped the run at step {step} after {self.streak} failing check(s) in a row: "
                            + "; ".join(reasons) + f"; best check: step {self.best['step']}")
        if distributed:  # every rank probed the same prompts and seeds; rank 0's decision is everyone's
            values, trained, reasons = self._agree(values, trained, reasons)
        grid = self.stage.run / "samples" / f"guard_step_{step:05d}.png"
        if not distributed or torch.distributed.get_rank() == 0:
            grid = save_grid(images[:len(prompts)], prompts, grid, sources=meta["source_images"] if meta else None)
        metrics = {f"guard/{k}": v for k, v in values.items()}
        metrics.update(self.per_category(scores, prompts))
        metrics.update({"guard/trained": trained, "guard/diversity": diversity, "guard/failing": len(reasons),
                        "guard/streak": self.streak, "guard/best_step": self.best["step"],
                        "guard/seconds": time.perf_counter() - t0})
        return metrics, grid

    def _agree(self, values: dict, trained: float, reasons: list[str]) -> tuple[dict, float, list[str]]:
        """Under torchrun: rank 0's check (values, trained reward, reasons) and state (baseline, streak,
        best, stopped) on every rank, so every rank logs and decides the same (a stop all ranks take)."""
        box = [(values, trained, reasons, self.state_dict())]
        torch.distributed.broadcast_object_list(box, src=0)
        values, trained, reasons, state = box[0]
        self.load_state_dict(state)
        return values, trained, reasons

    def per_category(self, scores: dict, prompts: list[str]) -> dict[str, float]:
        """``guard/<name>/<category>``: the mean over that category's prompts, for each guard reward
        with a ``categories(prompts)`` method (e.g. ``shapes_strict``: GenEval's per-category accuracy)."""
        out = {}
        for name, fn in self.fns.items():
            if callable(getattr(fn, "categories", None)):
                cats = fn.categories(prompts)
                for cat in dict.fromkeys(cats):
                    out[f"guard/{name}/{cat}"] = prompt_mean([v for v, c in zip(scores[name], cats) if c == cat])
        return out

    def failures(self, values: dict, trained: float, diversity: float) -> list[str]:
        """The failing conditions of one check against the baseline, as phrases naming the guard and the
        values (empty: the check passes)."""
        out = []
        base = self.baseline
        trained_up = self.trained is None or not math.isfinite(base["trained"]) or trained > base["trained"]
        fell = base["trained"] - trained if self.trained is not None else float("nan")
        lost = self.trained is not None and math.isfinite(base["trained"]) and not math.isfinite(trained)
        collapsing = self.cfg.collapse_by > 0 and (lost or (math.isfinite(fell)
                                                            and fell > self.cfg.collapse_by * abs(base["trained"])))
        if trained_up or collapsing:
            for name, v in values.items():
                b, limit = base[name], self.cfg.worse_by.get(name, self.cfg.default_worse_by)
                worse = (v - b) if name == LOSS else (b - v)
                if math.isfinite(worse) and worse > limit * abs(b):
                    what = "held-out flow-matching loss" if name == LOSS else f"guard reward {name}"
                    up = f"; trained reward {base['trained']:.4g} -> {trained:.4g}" if self.trained else ""
                    up += " (collapse: it fell too)" if collapsing else ""
                    out.append(f"{what} {b:.4g} -> {v:.4g} (worse by {worse / abs(b):.0%} > {limit:.0%}{up})")
        if self.cfg.min_diversity > 0 and diversity < self.cfg.min_diversity:
            out.append(f"within-group diversity {diversity:.4g} < min_diversity {self.cfg.min_diversity:g}")
        return out

    def _save_best(self, model: torch.nn.Module, record: dict) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / "best.safetensors.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable_state(self.stage.model, model).items()},
                  str(tmp))
        tmp.replace(self.folder / "best.safetensors")
        (self.folder / "best.json").write_text(json.dumps(record, indent=1) + "\n")

    def load_best(self, model: torch.nn.Module) -> int:
        """Load the best check's weights into ``model`` (the module the stage exports); returns its step."""
        from safetensors.torch import load_file

        state = load_file(str(self.folder / "best.safetensors"))
        missing = set(state) - set(dict(model.named_parameters()))
        if missing:
            raise RuntimeError(f"{self.folder / 'best.safetensors'}: parameters not in the model: {sorted(missing)[:3]}")
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in state.items():
                params[k].copy_(v)
        return self.best["step"]

    def state_dict(self) -> dict:
        return {"json": json.dumps({"baseline": self.baseline, "streak": self.streak, "best": self.best,
                                    "diversity": self.diversity, "stopped": self.stopped})}

    def load_state_dict(self, state: dict) -> None:
        saved = json.loads(state["json"])
        self.baseline, self.streak, self.best = saved["baseline"], saved["streak"], saved["best"]
        self.diversity, self.stopped = saved["diversity"], saved["stopped"]


def _mean_over_ranks(local: list[float]) -> float:
    """The mean of every rank's recorded values (a collective; NaN when no rank recorded one)."""
    t = torch.tensor([sum(local), float(len(local))], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else float("nan")


def describe(metrics: dict) -> str:
    """A check's metrics as one log line."""
    return ", ".join(f"{k[len('guard/'):]} {v:.4g}" if isinstance(v, float) else f"{k[len('guard/'):]} {v}"
                     for k, v in metrics.items())


def trainable_state(trained: torch.nn.Module, source: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``source``'s parameters whose names are trainable in ``trained`` (the LoRA adapters, or every weight
    in full fine-tuning); ``source`` is the module sampled and exported (the policy, or its EMA copy)."""
    names = {n for n, p in trained.named_parameters() if p.requires_grad}
    return {n: p for n, p in source.named_parameters() if n in names}
