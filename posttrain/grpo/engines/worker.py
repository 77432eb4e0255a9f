"""The rollout worker: one Ray actor (``ray.remote(RolloutWorker)``, started by
:class:`posttrain.grpo.engines.ray_pool.WorkerPool`) holding an inference copy of the policy (the export, the
adapter layout of ``policy:``) and a :class:`rollout.actor.RolloutActor` over it
(:func:`posttrain.grpo.actor.build_rollout_actor`, as the colocated trainer's). It samples
:class:`rollout.records.RolloutRequest` batches exactly as the colocated trainer would (same sampler
code, noise keyed by global sample id, the trainer's precision and speed options), with the weights of
the last packet it received."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from posttrain.base.policy import Policy
from posttrain.grpo.actor import build_rollout_actor
from posttrain.grpo.engines.weight_sync import WeightGroup, WeightPacket, checksum, frozen_tensors
from posttrain.grpo.perf import PerfConfig, apply_model_options, compile_models, no_grad_model
from pretrain.data.dataset import attach_codec, build_datasets
from pretrain.export import load_exported
from pretrain.text_encoder import PromptEmbeds
from rollout.records import RolloutRequest, RolloutResult
from rollout.sampler import Sampler


class RolloutWorker:
    """``cfg``: the run's :class:`posttrain.grpo.stage.GRPOConfig`; ``perf``: the trainer's resolved speed
    options (so the worker samples with the same function and rounding: the LoRA-merged copy or not, the
    module rewrites, compiled blocks and decoder);
    ``record_uncond``: False never keeps the unconditional CFG velocities; True leaves it to the run's
    rule (:func:`posttrain.grpo.actor.record_uncond`: sync mode, the update's precision); ``index``: the
    worker's slot; ``delay_s``: seconds added to every request (tests and benchmarks make one worker
    slow with it). Uses ``engine.num_cpus`` threads and its bundle's GPU when ``engine.num_gpus`` > 0,
    else the CPU."""

    def __init__(self, cfg, perf: PerfConfig, record_uncond: bool, index: int, delay_s: float = 0.0):
        torch.set_num_threads(max(1, int(cfg.engine.num_cpus)))
        self.index, self.delay_s = index, delay_s
        # the GPU of the worker's bundle when it has one (Ray sets CUDA_VISIBLE_DEVICES), else the CPU
        self.device = torch.device("cuda" if cfg.engine.num_gpus and torch.cuda.is_available() else "cpu")
        model, encoder, codec, meta = load_exported(cfg.model.pretrained, device=str(self.device),
                                                    options=cfg.model.options)
        train_set, _ = build_datasets(replace(cfg.data, size=meta["image_size"]), encoder)
        attach_codec(codec, train_set, encoder=encoder)
        self.policy = Policy(model, cfg.policy, reference=False)  # the layout; the weights arrive in packets
        apply_model_options(perf, model)  # the trainer's module rewrites, so the same rounding
        sampler = Sampler.build(cfg.rollout, model, encoder, self.device, meta["sampling"]["shift"])
        compile_models(perf, self.policy, codec)
        self.actor = build_rollout_actor(cfg, perf, policy=self.policy,
                                         sampling_model=lambda: nullcontext(no_grad_model(perf, self.policy, self.version)),
                                         sampler=sampler, codec=codec, prompts=train_set,
                                         image_size=meta["image_size"], device=self.device, keep_uncond=record_uncond)
        self.version = -1
        self.weights = None  # the collective weight group, when engine.weight_sync is collective

    def join_weights(self, host: str, port: int, rank: int, world: int, backend: str, generation: int) -> int:
        """Join the collective weight group (:class:`posttrain.grpo.engines.weight_sync.WeightGroup`) as
        ``rank``; returns ``rank``."""
        self.weights = WeightGroup(host, port, rank, world, backend, generation)
        return rank

    def receive(self, meta: dict) -> int:
        """Receive a pushed packet through the collective group (every member at once), verify and
        apply it; returns the version now held."""
        return self.load(self.weights.broadcast(meta=meta))

    def ping(self) -> dict:
        """The worker's slot, process id and weights version (a liveness check)."""
        return {"worker": self.index, "pid": os.getpid(), "version": self.version}

    def load(self, packet: WeightPacket) -> int:
        """Apply ``packet`` (checksum checked first: :class:`posttrain.grpo.engines.weight_sync.WeightSyncError`);
        returns the version now held."""
        packet.apply(self.policy.model)
        self.version = packet.version
        return self.version

    @torch.no_grad()
    def probe(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> dict:
        """A post-sync self-check to compare with the trainer's policy: the velocity of the module this
        worker samples with (its LoRA-merged copy with ``perf.merge_lora``, else the policy) at the
        weights it holds, in the rollout's autocast, on ``x`` (float32 ``[B, C, H, W]``, ``[B, C, F, H, W]``
        for videos), ``sigma`` (float32 ``[B]``) and ``embeds`` (a
        :class:`pretrain.text_encoder.PromptEmbeds` of B rows). Returns ``{"version": weights held,
        "velocity": float32 CPU tensor shaped like x, "lora_modules": the policy's LoRA-wrapped modules
        (:meth:`posttrain.base.policy.Policy.lora_modules`), "base_checksum": checksum of its frozen
        weights (:func:`posttrain.grpo.engines.weight_sync.frozen_tensors`), "base_dtypes": their dtype
        names, sorted}``."""
        with self.actor.model() as model, self.actor.precision.autocast():
            v = model(x.to(self.device), sigma.to(self.device), embeds.to(self.device))
        frozen = frozen_tensors(self.policy.model)
        return {"version": self.version, "velocity": v.float().cpu(), "lora_modules": self.policy.lora_modules(),
                "base_checksum": checksum(frozen), "base_dtypes": sorted({str(t.dtype) for t in frozen.values()})}

    def sample(self, request: RolloutRequest, packet: WeightPacket | None = None) -> RolloutResult:
        """Sample ``request`` with the actor (after applying ``packet`` when it is newer than the weights
        held). ``RuntimeError`` when no weights were ever received."""
        if packet is not None and packet.version != self.version:
            self.load(packet)
        if self.version < 0:
            raise RuntimeError(f"rollout worker {self.index}: asked to sample {request.request_id} before any weights "
                               f"were pushed")
        t0 = time.perf_counter()
        result = self.actor.sample(request, version=self.version, worker=self.index)
        if self.delay_s:
            time.sleep(self.delay_s)
            result.rollout_s = time.perf_counter() - t0
        return result
