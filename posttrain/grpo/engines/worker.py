"""The rollout worker: one Ray actor (``ray.remote(RolloutWorker)``, started by
:class:`posttrain.grpo.engines.ray_pool.WorkerPool`) holding an inference copy of the policy (the export, the
adapter layout of ``policy:``) and the sampler of ``rollout:``. It samples :class:`rollout.records.RolloutRequest`
batches exactly as the colocated trainer would (same sampler code, noise keyed by global sample id,
the trainer's precision and speed options), with the weights of the last packet it received."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from posttrain.grpo.engines.weight_sync import WeightGroup, WeightPacket
from posttrain.grpo.perf import PerfConfig, apply_model_options, compile_models, records_uncond
from posttrain.base.policy import Policy
from pretrain.data.dataset import build_datasets
from pretrain.export import load_exported
from pretrain.runtime.precision import Precision
from rollout.records import RolloutRequest, RolloutResult
from rollout.sampler import Sampler
from rollout.timed_codec import TimedCodec


class RolloutWorker:
    """``cfg``: the run's :class:`posttrain.grpo.stage.GRPOConfig`; ``perf``: the trainer's resolved speed
    options (so the worker samples with the same function and rounding: the LoRA-merged copy or not, the
    module rewrites, compiled blocks and decoder);
    ``record_uncond``: keep the unconditional CFG velocities (sync mode only: they are the trainer's
    only while the weights are, and only in the update's precision); ``index``: the worker's slot;
    ``delay_s``: seconds added to every request (tests and benchmarks make one worker slow with it).
    Uses ``rollout.num_cpus`` threads and its bundle's GPU when ``rollout.num_gpus`` > 0, else the CPU."""

    def __init__(self, cfg, perf: PerfConfig, record_uncond: bool, index: int, delay_s: float = 0.0):
        torch.set_num_threads(max(1, int(cfg.rollout.num_cpus)))
        self.index, self.delay_s, self.seed = index, delay_s, cfg.train.seed
        # the GPU of the worker's bundle when it has one (Ray sets CUDA_VISIBLE_DEVICES), else the CPU
        self.device = torch.device("cuda" if cfg.rollout.num_gpus and torch.cuda.is_available() else "cpu")
        model, encoder, self.codec, meta = load_exported(cfg.model.pretrained, device=str(self.device),
                                                         options=cfg.model.options)
        self.train_set, _ = build_datasets(replace(cfg.data, size=meta["image_size"]), encoder)
        self.policy = Policy(model, cfg.policy, reference=False)  # the layout; the weights arrive in packets
        apply_model_options(perf, model)  # the trainer's module rewrites, so the same rounding
        ro = cfg.rollout
        shift = meta["sampling"]["shift"] if ro.shift is None else ro.shift
        self.sampler = Sampler.build(ro, model, encoder, self.device, shift)
        self.update = cfg.grpo.build().update(cfg.grpo, perf, self.policy)
        compile_models(perf, self.policy, self.codec)
        self.precision = Precision(ro.precision or cfg.train.precision, self.device)
        self.latent_shape = self.codec.latent_shape(meta["image_size"], meta["image_size"])
        self.shared = ro.group_size if ro.shared_initial_noise else None
        self.record_uncond = (record_uncond and records_uncond(perf, cfg.grpo.detach_uncond, ro.guidance_scale)
                              and (ro.precision or cfg.train.precision) == cfg.train.precision)
        self.version = -1
        self.weights = None  # the collective weight group, when rollout.weight_sync is collective

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
    def sample(self, request: RolloutRequest, packet: WeightPacket | None = None) -> RolloutResult:
        """Sample ``request`` (after applying ``packet`` when it is newer than the weights held).
        ``RuntimeError`` when no weights were ever received."""
        if packet is not None and packet.version != self.version:
            self.load(packet)
        if self.version < 0:
            raise RuntimeError(f"rollout worker {self.index}: asked to sample {request.request_id} before any weights "
                               f"were pushed")
        t0 = time.perf_counter()
        codec = TimedCodec(self.codec)
        self.policy.model.eval()
        model = self.update.rollout_model(self.policy, self.version).eval()
        _, embeds, captions = self.train_set.batch(list(request.prompt_ids))
        with self.precision.autocast():
            traj = self.sampler.sample(model, codec, embeds, captions, group_ids=torch.as_tensor(request.group_ids),
                                       sample_ids=list(request.sample_ids), latent_shape=self.latent_shape,
                                       seed=self.seed, iteration=request.iteration, device=self.device,
                                       shared_group_size=self.shared, record_uncond=self.record_uncond)
        traj.versions = torch.full((len(traj),), self.version, dtype=torch.long)
        if self.delay_s:
            time.sleep(self.delay_s)
        return RolloutResult(request.request_id, request.iteration, traj.to("cpu"), self.version, self.index,
                             time.perf_counter() - t0, codec.seconds)
