"""Speed options of the post-training loops. None changes the algorithm: the loss and the gradients
are the same up to float rounding (tests/integration/test_perf.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.models.activations import rewrite_tanh_gelu
from posttrain.base.compile import compile_blocks


@dataclass
class PerfConfig:
    """``merge_lora``: no-grad forwards (the rollout, the detached unconditional CFG branch in training)
    run on a copy of the policy with LoRA merged into its weights, W + scale * B A, refreshed after every
    optimizer step: no adapter matmuls where no gradient is needed. None (default) = on where it holds:
    a LoRA policy, fp32, one process. ``true`` is refused under bf16/fp16 autocast (the merged weights
    round differently from base + adapter and the first ratio would drift from 1) and under
    ``torchrun`` (the copy would deep-copy sharded weights). ``uncond_in_batch``: run the detached
    unconditional branch inside the conditional forward as one 2B batch with a graph (flow_grpo's layout:
    the same gradient, a backward over both halves; off by default, kept as the baseline).
    ``transitions_per_forward``: trained transitions of a mini-batch computed in one forward/backward
    (k x batch rows; 1 = one transition at a time as flow_grpo does, 0 = all at once): the same loss
    (the mean over transitions) and gradients, bigger matrix products, k times the activation memory.
    ``compile``: ``torch.compile`` each transformer block (policy, merged copy; first iterations are
    slower while it compiles). ``reward_workers``: threads scoring rewards while the next rollout batch
    is sampled (0 = score after the whole rollout). ``reuse_rollout_uncond``: the rollout keeps its
    unconditional CFG velocities (one more latent-sized tensor per transition) and the mini-batches
    trained before the iteration's first optimizer step use them instead of a forward: the weights
    are still the rollout's, so the values are the same (up to batch-layout rounding). With one
    optimizer step per iteration (``grad_accum`` covering the buffer) no unconditional forward is
    left in training. Only with a detached unconditional branch and not ``uncond_in_batch``, and not kept
    when ``rollout.precision`` differs from ``train.precision`` or the samples are stale (Ray workers
    in ``one_step_off`` / ``async`` mode). ``sigmoid_gelu``: the blocks' tanh-approximate GELUs compute
    ``x * sigmoid(2z)``, the same function (:mod:`pretrain.models.activations`), with the MLP
    projection's bias added in the activation's kernel; about 2.8x faster per element under compile on a
    CPU, slower in eager mode. None (default) = on with ``compile``. ``compile_decoder``: ``torch.compile``
    the VAE decoder that turns the rollout's latents into images for the reward (an ``AutoencoderKL``
    codec; pixel-space and video codecs stay eager): its group norms, SiLUs and residual adds fuse. The
    images match the eager decoder's to float rounding (about 2e-5 in [0, 1]), which can move a pixel
    at a quantisation boundary by one level in an 8-bit reward input. Off by default: on a 2-core CPU with
    ``train.keep_freed_memory`` it saved about 0.5 % of an iteration (366 -> 338 ms per batch of 8).

    ``preset``: the options measured fastest on a kind of machine (docs/performance.md), applied to every
    option of :data:`PRESETS` left unset (None; an option given any value, the default's included,
    wins): "cpu" (compile, which brings ``sigmoid_gelu``; the reward scored after
    the rollout, as a scoring thread competes with the sampler for a few cores: for a reward that
    waits, e.g. a served model, add ``reward_workers`` >= 1), "gpu" (compile; real models),
    "gpu_small" (compile, all trained transitions in one forward: a small model is bound by kernel
    launches), "none" (default). Unset options a preset does not set take the defaults of
    :data:`UNSET_DEFAULTS` (compile off, one reward worker, one transition per forward)."""

    merge_lora: bool | None = None
    uncond_in_batch: bool = False
    transitions_per_forward: int | None = None
    compile: bool | None = None
    reward_workers: int | None = None
    reuse_rollout_uncond: bool = True
    sigmoid_gelu: bool | None = None
    compile_decoder: bool = False
    preset: str = "none"

    def validate(self, prefix: str = "") -> None:
        if self.preset != "none" and self.preset not in PRESETS:
            raise ValueError(f"{prefix}preset: unknown '{self.preset}'; known: none, {', '.join(PRESETS)}")
        if self.transitions_per_forward is not None and self.transitions_per_forward < 0:
            raise ValueError(f"{prefix}transitions_per_forward: must be >= 0 (0 = all), got "
                             f"{self.transitions_per_forward}")
        if self.reward_workers is not None and self.reward_workers < 0:
            raise ValueError(f"{prefix}reward_workers: must be >= 0, got {self.reward_workers}")


# preset -> options it sets (where they are unset); measured in benchmarks/grpo_iteration.py
PRESETS: dict[str, dict[str, object]] = {
    "cpu": {"compile": True, "reward_workers": 0},
    "gpu": {"compile": True},
    "gpu_small": {"compile": True, "transitions_per_forward": 0},
}


# what an option a preset can set means when it is left unset and the preset does not set it
UNSET_DEFAULTS: dict[str, object] = {"compile": False, "reward_workers": 1, "transitions_per_forward": 1}


def apply_preset(perf: PerfConfig) -> PerfConfig:
    """``perf`` with every unset (None) option of :data:`UNSET_DEFAULTS` set: to its ``preset``'s value
    where the preset has one, else to the default. Options given a value keep it. Idempotent."""
    from dataclasses import replace

    chosen = {**UNSET_DEFAULTS, **PRESETS.get(perf.preset, {})}
    return replace(perf, **{k: v for k, v in chosen.items() if getattr(perf, k) is None})


def merge_lora_blocker(precision: str, distributed: bool) -> str | None:
    """Why a LoRA-merged copy cannot serve the no-grad forwards here, or None."""
    if precision != "fp32":
        return (f"train.precision={precision}: merged weights round differently from base + adapter, the first "
                f"ratio would drift from 1")
    return "several ranks: the merged copy would deep-copy FSDP2-sharded weights" if distributed else None


def resolve_perf(perf: PerfConfig, precision: str, distributed: bool, lora: bool = True,
                 compile_blocker: str | None = None) -> PerfConfig:
    """``perf`` with its preset applied (:func:`apply_preset`), ``merge_lora`` resolved: None = on for a
    LoRA policy in fp32 in one process; off without LoRA (nothing to merge); and ``sigmoid_gelu``: None =
    ``compile``. ``compile_blocker``: why compile cannot run, or is untested, under the run's sharded
    layout (:meth:`pretrain.parallel.config.ParallelConfig.untested_compile`); a preset then leaves compile
    off, while an explicit ``compile: true`` stays (and is refused where it cannot run: ``parallel.tp`` > 1). Raises
    ``ConfigError`` naming ``perf.merge_lora`` when it is set true where it cannot hold (bf16/fp16,
    several ranks): a setting the code cannot honour is refused, never rewritten."""
    from dataclasses import replace

    from pretrain.config import ConfigError

    if perf.compile is None and compile_blocker:
        perf = replace(perf, compile=False)  # what the preset would set; an unset default is off anyway
    perf = apply_preset(perf)
    blocker = merge_lora_blocker(precision, distributed)
    if perf.merge_lora and lora and blocker:
        raise ConfigError(f"perf.merge_lora=true cannot be honoured with {blocker}; set perf.merge_lora=false")
    wanted = blocker is None if perf.merge_lora is None else perf.merge_lora
    gelu = perf.compile if perf.sigmoid_gelu is None else perf.sigmoid_gelu
    return replace(perf, merge_lora=bool(wanted and lora), sigmoid_gelu=gelu)


def records_uncond(perf: PerfConfig, detach_uncond: bool, guidance_scale: float) -> bool:
    """Whether the update reuses unconditional velocities a rollout recorded (and so whether a rollout
    drawn with the update's weights and precision keeps them: :func:`posttrain.grpo.actor.record_uncond`)."""
    return perf.reuse_rollout_uncond and detach_uncond and not perf.uncond_in_batch and guidance_scale != 1.0


def no_grad_model(perf: PerfConfig, policy, version: int) -> torch.nn.Module:
    """The module no-grad forwards of ``policy`` (a :class:`posttrain.base.policy.Policy`) run on: its
    LoRA-merged copy refreshed at ``version`` with ``perf.merge_lora`` (resolved), else the policy itself."""
    return policy.inference_model(version) if perf.merge_lora else policy.model


def compile_decoder(codec: object) -> bool:
    """``torch.compile`` the decoder of a :class:`pretrain.codec.VAECodec` (``codec.vae.decoder``, a diffusers
    ``AutoencoderKL``'s) in place; returns whether it did. Other codecs are left as they are: pixel-space
    ones have nothing to fuse, and video VAEs' decoders keep Python-side frame caches that would break
    the graph at every frame."""
    from pretrain.codec import VAECodec

    if not isinstance(codec, VAECodec):
        return False
    codec.vae.decoder.compile()
    return True


def compile_models(perf: PerfConfig, policy, codec: object, blocks: bool = True) -> None:
    """``perf.compile``: compile every block of ``policy.model`` (a :class:`posttrain.base.policy.Policy`) and of
    its LoRA-merged copy, made here first when ``perf.merge_lora`` (a deep copy of compiled blocks would
    not be one); ``perf.compile_decoder``: ``codec``'s VAE decoder (:func:`compile_decoder`). ``blocks``
    False: the blocks are compiled elsewhere (under ``torchrun``, when they are sharded). ``perf``:
    resolved (:func:`resolve_perf`)."""
    if perf.compile and blocks:
        merged = policy.inference_model(-1) if perf.merge_lora else None
        for m in filter(None, (policy.model, merged)):
            compile_blocks(m)
    if perf.compile_decoder:
        compile_decoder(codec)


def apply_model_options(perf: PerfConfig, *models: torch.nn.Module | None) -> None:
    """The options that rewrite modules, applied in place to each model that is not None before it is
    sharded or compiled (a later deep copy, e.g. the LoRA-merged one, keeps them): ``sigmoid_gelu``."""
    if perf.sigmoid_gelu:
        for model in filter(None, models):
            rewrite_tanh_gelu(model)
