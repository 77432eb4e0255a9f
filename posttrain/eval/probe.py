"""The held-out probe of a sweep: the same prompts, seeds and rewards for every arm, evaluated on the
in-memory model at fixed points of training (no export, no reload).

One probe = P held-out prompts x K seeds sampled with the deterministic ODE
(:func:`posttrain.eval.evaluate.paired_samples`), scored by the task's headline reward and its guard
reward (one the arms are not trained on), plus the held-out flow-matching loss of the export's
objective (:func:`pretrain.evaluation.heldout_loss`). Per-prompt means are kept so that any two
probes of one task pair prompt by prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from posttrain.eval.evaluate import EvalConfig, eval_prompts, paired_samples, parse_eval_reward, reward_metadata
from pretrain.evaluation import heldout_loss
from pretrain.objective import FlowConfig
from rewards.base import build_reward


@dataclass
class ProbeConfig:
    """``num_prompts`` held-out prompts (evenly spaced) x ``samples_per_prompt`` seeds from ``seed``,
    ODE ``num_inference_steps`` at ``guidance_scale``; ``guard_samples`` held-out images for the
    flow-matching-loss guard; ``batch_size`` samples per forward."""

    num_prompts: int = 32
    samples_per_prompt: int = 1
    seed: int = 0
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    guard_samples: int = 64
    batch_size: int = 64

    def validate(self, prefix: str = "") -> None:
        from pretrain.config import require_positive

        require_positive(self, prefix, "num_prompts", "samples_per_prompt", "num_inference_steps", "batch_size")

    def eval_config(self) -> EvalConfig:
        return EvalConfig(rewards=[], prompts="heldout", num_prompts=self.num_prompts,
                          samples_per_prompt=self.samples_per_prompt, seed=self.seed,
                          num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                          guard_samples=self.guard_samples, batch_size=self.batch_size)


@dataclass
class ProbeRewards:
    """The task's rewards as eval entries (``NAME`` or ``NAME@PATH``, see
    :func:`posttrain.eval.evaluate.parse_eval_reward`): ``reward`` the headline, ``guard`` the second,
    ``trained`` (optional, "" for none) a learned reward that arms train on."""

    reward: str
    guard: str
    trained: str = ""
    fns: dict = field(default_factory=dict)

    def build(self) -> "ProbeRewards":
        for entry in (self.reward, self.guard, *([self.trained] if self.trained else [])):
            name, params = parse_eval_reward(entry)
            self.fns[entry] = build_reward(name, **params)
        return self


def prompt_mean(values: list[float]) -> float:
    """The mean of a probe's per-prompt values over the finite ones (NaN when none is)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


@torch.no_grad()
def probe_scores(model: torch.nn.Module, stage, cfg: ProbeConfig, fns: dict
                 ) -> tuple[dict, float, torch.Tensor, list, dict | None]:
    """Sample ``model`` (a :class:`pretrain.backbone.Backbone`, put in eval mode and back) on the held-out
    prompts of ``stage`` (a :class:`posttrain.base.stage.PolicyStage`) and score the images with each of
    ``fns`` (``{key: fn(images, prompts, metadata) -> float [N]}``). Returns (``{key: [P] per-prompt
    means}`` (NaN rewards stay NaN), the held-out flow-matching loss of the export's objective (NaN
    with ``guard_samples`` 0), the images float32 ``[K * P, 3, H, W]`` in [0, 1], the P prompts, the
    rewards' metadata: :func:`posttrain.eval.evaluate.reward_metadata`, None for text-only prompts)."""
    ecfg = cfg.eval_config()
    prompts, rows = eval_prompts(ecfg, stage.held, stage.train_set)
    was_training = model.training
    model.eval()
    try:
        embeds = stage.held.prompt_embeds(prompts, stage.encoder, rows)
        images = paired_samples(model, stage.codec, embeds, stage.null, ecfg, image_size=stage.meta["image_size"],
                                shift=stage.meta["sampling"]["shift"], device=stage.device)
        k, p = cfg.samples_per_prompt, len(prompts)
        meta = reward_metadata(stage.codec, embeds, k, ecfg.batch_size)
        scores = {key: fn(images, prompts * k, meta).float().view(k, p).mean(0).tolist() for key, fn in fns.items()}
        loss = float("nan")
        if cfg.guard_samples:
            flow = FlowConfig(objective=stage.meta.get("objective", "rectified_flow"))
            loss = heldout_loss(model, stage.codec, stage.held, stage.null, flow, seed=cfg.seed,
                                num_samples=cfg.guard_samples, device=stage.device)
    finally:
        model.train(was_training)
    return scores, loss, images, prompts, meta


def probe(model: torch.nn.Module, stage, cfg: ProbeConfig, rewards: ProbeRewards) -> dict:
    """A sweep's probe (:func:`probe_scores` with the task's rewards). Returns ``{"reward": [P]
    per-prompt means, "guard_reward": [P], "guard_loss": float}``, and ``"trained_reward": [P]`` when
    ``rewards.trained`` is set."""
    fns = {"reward": rewards.fns[rewards.reward], "guard_reward": rewards.fns[rewards.guard]}
    if rewards.trained:
        fns["trained_reward"] = rewards.fns[rewards.trained]
    scores, loss, *_ = probe_scores(model, stage, cfg, fns)
    return {**scores, "guard_loss": loss}
