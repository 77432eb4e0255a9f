"""Checks every pipeline family's tests make: the rollout's log-probs recomputed in training
(:func:`worst_ratio_deviation`), and the export of a GRPO run, loaded by the diffusers pipeline and as
the source folder plus the exported LoRA, reproducing our sampler's images (:func:`export_vs_pipeline`)."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents


def max_diff(a, b) -> float:
    """Max |a - b| over every element, as float32."""
    return (torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max().item()


def worst_ratio_deviation(folder, options: dict, prompts: list[str], steps: int, scale: float, size: int) -> float:
    """Max |ratio - 1| of a rollout's log-probs recomputed in training: ``folder`` loaded with a perturbed
    LoRA policy (:func:`tests.families.lora_policy.perturbed_lora_policy`), 6 samples (3 prompts x group 2,
    rollout batches of 4, SDE noise level 0.7, CFG ``scale``) recomputed in train mode in mini-batches of 3
    at every transition."""
    import itertools

    from pretrain.data.dataset import EncodedSet
    from rollout.sampler import log_prob
    from tests.conftest import sampler_rollout
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, _ = load_exported(folder, options=options)
    data = EncodedSet(torch.zeros(len(prompts), 3, 16, 16, dtype=torch.uint8), list(prompts), encoder.encode(prompts))
    perturbed_lora_policy(model)
    traj = sampler_rollout(model.eval(), codec, data, [0, 1, 2], group=2, batch=4, null=encoder.encode([""]),
                           sigmas=model.sigmas(steps), noise=0.7, scale=scale,
                           latent_shape=codec.latent_shape(size, size))
    model.train()
    worst = 0.0
    with torch.enable_grad():
        for start, t in itertools.product((0, 3), range(steps)):
            mb = traj.select(torch.arange(start, start + 3))
            ratio = torch.exp(log_prob(model, mb, t).log_prob - mb.log_probs[:, t])
            worst = max(worst, (ratio - 1).abs().max().item())
    return worst


def one_grpo_iteration(run_dir, folder, scale: float, *overrides: str):
    """One GRPO iteration (LoRA) on the pipeline folder ``folder`` from ``configs/grpo/emoji_tiny.yaml``:
    2 prompts x group 2, 3 rollout steps at CFG ``scale``, lr 3e-2, then ``overrides`` (the family's
    ``model.options``, rewards). Asserts the first PPO ratio is 1 within 1e-5 (the recomputation equals the
    rollout); returns the export folder."""
    from posttrain.grpo.stage import train
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import grpo_config

    export = train(grpo_config(run_dir, folder, "data.limit=4", "train.steps=1", "rollout.num_inference_steps=3",
                               "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
                               "train.batch_size=4", f"rollout.guidance_scale={scale}", "optim.lr=3e-2",
                               "eval.grid_prompts=2", "eval.num_inference_steps=2", f"eval.guidance_scale={scale}",
                               *overrides))
    first = read_metrics(Path(run_dir) / "grpo/metrics.jsonl")[0]
    assert abs(first["ratio_min"] - 1) <= 1e-5 and abs(first["ratio_max"] - 1) <= 1e-5, first
    return export


def export_vs_pipeline(pipeline_cls, source, export, lora_dir, run, *, size: int, steps: int, scale: float,
                       prompt: str, options: dict | None = None) -> tuple[float, float, float]:
    """Max |difference| of our ODE images (``load_exported(export, options)``, ``steps`` steps, CFG
    ``scale``, seed 0) against ``run(pipe, noise)`` (the pipeline's images from our initial noise) for
    ``pipeline_cls.from_pretrained(export)``, for the ``source`` pipeline with ``load_lora_weights(lora_dir)``
    and for the bare ``source`` pipeline: ``(d_export, d_lora, d_base)``."""
    model, encoder, codec, _ = load_exported(export, options=options)
    noise = initial_noise(1, codec.latent_shape(size, size), 0)
    ours = codec.decode(sample_latents(model, encoder.encode([prompt]), encoder.encode([""]), noise, steps, scale,
                                       None))

    def diff(pipe) -> float:
        pipe.set_progress_bar_config(disable=True)
        return max_diff(run(pipe, noise), ours)

    with_lora = pipeline_cls.from_pretrained(source)
    with_lora.load_lora_weights(str(lora_dir))
    return diff(pipeline_cls.from_pretrained(export)), diff(with_lora), diff(pipeline_cls.from_pretrained(source))


def recomputed_with_recorded_images(model, traj, steps: int) -> tuple[float, float]:
    """For a 6-sample trajectory whose prompts carry conditioning images: (max |ratio - 1| of its log-probs
    recomputed in train mode in mini-batches of 3 at every transition, how far the step-1 mean of the
    first 3 samples moves, relative to its size, when their images are swapped among them)."""
    from pretrain.text_encoder import PromptEmbeds
    from rollout.sampler import log_prob

    model.train()
    worst = 0.0
    with torch.enable_grad():
        for start in (0, 3):
            mb = traj.select(torch.arange(start, start + 3))
            for t in range(steps):
                ratio = torch.exp(log_prob(model, mb, t).log_prob - mb.log_probs[:, t])
                worst = max(worst, (ratio - 1).abs().max().item())
        swapped = traj.select(torch.arange(3))
        swapped.embeds = PromptEmbeds(swapped.embeds.tokens, swapped.embeds.pooled, swapped.embeds.images.flip(0))
        same = log_prob(model, traj.select(torch.arange(3)), 1).mean
        moved = (log_prob(model, swapped, 1).mean - same).abs().max().item() / same.abs().max().item()
    return worst, moved
