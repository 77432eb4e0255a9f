"""`posttrain pretrain`: flow-matching pretraining of a text-conditioned denoiser (any registered model
family with presets: images or videos) on the shared runtime."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pretrain.codec import CodecConfig, build_codec
from pretrain.config import ConfigError
from pretrain.data.dataset import attach_codec, build_datasets
from pretrain.data.feed import BatchFeed
from pretrain.data.latent_cache import require_codec
from pretrain.data.stream import sampler_for
from pretrain.export import ExportMeta, export_model
from pretrain.models import arch_of, build_backbone, count_parameters
from pretrain.objective import FlowConfig, draw_training_noise, objective_sigmas, pretrain_loss
from pretrain.parallel.job import JobRanks
from pretrain.run_config import RunConfig
from pretrain.runtime.accumulate import Accumulation
from pretrain.runtime.config import RuntimeConfig
from pretrain.runtime.loop import run_stage
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.profiling import StepProfiler
from pretrain.runtime.config_record import record_config
from pretrain.runtime.spikes import sigma_buckets
from pretrain.runtime.host import configure_host
from pretrain.runtime.runtime import Runtime, resolve_device
from pretrain.seeding import seed_for
from pretrain.evaluation import heldout_loss, write_grid
from pretrain.text_encoder import TextEncoderConfig, text_encoder_from_config

log = logging.getLogger(__name__)


@dataclass
class PretrainEvalConfig:
    """Held-out loss every ``every`` steps on ``heldout_samples`` fixed (noise, sigma) draws; a grid of
    ``grid_prompts`` held-out prompts every ``grid_every`` steps (and at the end) sampled with
    ``num_inference_steps`` Euler steps, ``guidance_scale`` and ``shift`` (null: the model's own schedule,
    required by families whose scheduler owns it, e.g. the UNet). The export records these three as its
    sampling defaults."""

    every: int = 50
    heldout_samples: int = 256
    grid_every: int = 0
    grid_prompts: int = 16
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    shift: float | None = 1.0


@dataclass
class PretrainConfig(RunConfig):
    """Everything `posttrain pretrain` reads; outputs go to ``<run_dir>/pretrain/``. ``train.batch_size``
    is the global micro-batch: under ``torchrun`` each data-parallel rank takes its contiguous share
    (``batch_size / dp``) of every micro-batch; ``parallel``: degrees and FSDP2 options. A step is one
    optimizer step (``train.steps``, ``checkpoint.every``, ``eval.every``, the metrics ``step`` and the
    checkpoint folders count them); ``profile.steps``: steps to trace (``<run>/pretrain/profile/``)."""

    run_dir: str = "runs/pretrain"
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    eval: PretrainEvalConfig = field(default_factory=PretrainEvalConfig)

    def validate(self, prefix: str = "") -> None:
        if self.data.size < 1:
            raise ValueError(f"data.size: must be >= 1, got {self.data.size}")
        family = arch_of(self.model.arch)
        if family.build is None:
            raise ValueError(f"model.arch: '{self.model.arch}' has no presets to pretrain (its pipeline folders "
                             f"load as model.pretrained of a post-training stage)")
        presets, video = family.presets, family.video
        if video != (self.codec.name == "video_patchify") and self.codec.name != "vae":
            raise ValueError(f"codec.name: '{self.codec.name}' does not fit model.arch '{self.model.arch}' "
                             f"(a video family takes video_patchify, an image family patchify)")
        if self.codec.frame_code and self.codec.name != "video_patchify":
            raise ValueError(f"codec.frame_code: only the video_patchify codec has a frame code, not '{self.codec.name}'")
        if video and self.codec.frames != self.data.frames:
            raise ValueError(f"codec.frames: {self.codec.frames} differs from data.frames {self.data.frames}")
        if not self.model.pretrained:
            if self.model.preset not in presets:
                raise ValueError(f"model.preset: unknown preset '{self.model.preset}'; known: {sorted(presets)}")
            unknown = set(self.model.overrides) - set(presets[self.model.preset]) - set(family.overrides)
            if unknown:
                raise ValueError(f"model.overrides: unknown field(s) {sorted(unknown)}")
            patch = {**presets[self.model.preset], **self.model.overrides}.get("patch_size", 1)
            patch = (patch[-1] if isinstance(patch, (list, tuple)) else patch) * self.codec.factor
            if self.data.size % patch:
                raise ValueError(f"data.size: {self.data.size} is not divisible by the patch size {patch}")
            for h, w in self.data.buckets:  # the model's positions are built for data.size x data.size
                if h % patch or w % patch or max(h, w) > self.data.size:
                    raise ValueError(f"data.buckets: [{h}, {w}] must be multiples of the patch size {patch} and "
                                     f"at most data.size {self.data.size} (the largest side the model is built for)")
        if self.data.buckets and video:
            raise ValueError(f"data.buckets: model.arch '{self.model.arch}' is a video family; buckets are for images")


def batch_arithmetic(cfg: RuntimeConfig, n_train: int, dp: int = 1) -> str:
    """The start-up line: samples per optimizer step = global micro-batch x accumulation (``dp``
    data-parallel ranks split each micro-batch, they do not multiply it)."""
    per_step = cfg.batch_size * cfg.grad_accum
    ranks = f" (split over {dp} data-parallel ranks: {cfg.batch_size // dp} each)" if dp > 1 else ""
    return (f"batch: {per_step} samples/step = micro-batch {cfg.batch_size}{ranks} x accumulation {cfg.grad_accum}"
            f"; {n_train} train samples -> {n_train / per_step:.1f} optimizer steps/epoch; "
            f"{cfg.steps} steps = {cfg.steps * per_step / n_train:.2f} epochs")


def train_step(model, rt: Runtime, feed: BatchFeed, codec, *, null, cfg: PretrainConfig, device,
               ranks: JobRanks | None = None, train_sigmas: torch.Tensor | None = None) -> dict:
    """One optimizer step over ``train.grad_accum`` global micro-batches of ``train.batch_size`` samples
    from ``feed`` (:class:`pretrain.data.feed.BatchFeed`: every rank draws the same indices and trains
    its ``ranks.share`` of each), with per-sample noise keyed by (seed, step, position within the step),
    so N ranks train what one process trains. ``loss`` is the mean over the global batch (all-reduced;
    a micro-batch that lost samples to bad data sums the kept ones over its nominal size, on any number
    of ranks). ``train_sigmas``: the
    table ``flow.objective`` draws from (:func:`pretrain.objective.objective_sigmas`, computed once per
    run), None for a continuous one. Returns the step's metrics, with ``data_wait_s`` (this rank's
    seconds waiting for data), ``data_wait_share`` (of the step's time), ``data_skipped`` (samples
    skipped this step, summed over ranks) and, with aspect-ratio buckets, ``samples_<H>x<W>`` (the
    step's global samples per bucket)."""
    step, t0 = rt.step, time.perf_counter()
    b, accum = cfg.train.batch_size, cfg.train.grad_accum
    model.train()
    acc, buckets, metrics, wait, skipped, per_bucket = Accumulation(rt), {}, {}, 0.0, [], {}
    for micro in range(accum):
        fed = feed.next()
        wait, skipped = wait + fed.wait_s, skipped + fed.skipped
        if getattr(feed.data, "buckets", None):  # samples per aspect-ratio bucket in this step
            key = f"samples_{fed.shape[0]}x{fed.shape[1]}"
            per_bucket[key] = per_bucket.get(key, 0) + b
        x0, embeds, weight = _inputs(fed, codec, null, device)
        noise, sigma, drop = draw_training_noise(x0, cfg.train.seed, step, [micro * b + p for p in fed.positions]
                                                 or [micro * b], cfg.flow, train_sigmas=train_sigmas)
        with rt.autocast():
            per = pretrain_loss(model, x0, embeds, null, noise, sigma, drop, cfg.flow.objective,
                                per_sample=True)
            # skipped samples: the kept ones' sum over the nominal share, so N ranks train what one does
            loss = (per.mean() if not fed.skipped else per.sum() / max(1, fed.nominal)) * weight
        acc.backward(loss)
        for name, (total, n) in sigma_buckets(sigma, per.detach()).items() if weight else ():  # spike buckets
            before = buckets.get(name, (0.0, 0))
            buckets[name] = (before[0] + total, before[1] + n)
        # the logged loss is the global batch's (the mean over ranks)
        metrics = acc.end_micro_batch(buckets, ranks.mean if ranks else None)
    seconds = time.perf_counter() - t0
    if skipped:
        log.warning("step %d: skipped %d bad sample(s): %s", step + 1, len(skipped),
                    "; ".join(f"{s}:{k} ({r})" for s, k, r in skipped[:5]))
    n_skipped = round(ranks.mean([float(len(skipped))])[0] * ranks.dp_size) if ranks else len(skipped)
    metrics.update(samples_per_s=b * accum / seconds, data_wait_s=wait, data_wait_share=wait / seconds,
                   data_skipped=n_skipped, **per_bucket)
    return metrics


def _inputs(fed, codec, null, device) -> tuple[torch.Tensor, object, float]:
    """(x0, embeds, loss weight) of a fed micro-batch share: latents from a cache, else the codec's
    encoding of the images; a share whose every sample was skipped trains one zero sample with the null
    prompt at weight 0 (the ranks' collectives still run)."""
    if fed.latents is not None:
        return fed.latents.to(device), fed.embeds.to(device), 1.0
    if fed.images is not None:
        return codec.encode(fed.images.to(device)), fed.embeds.to(device), 1.0
    return torch.zeros(1, *codec.latent_shape(*fed.shape), device=device), null, 0.0


class PretrainRun:
    """One pretraining run, set up from ``cfg`` (data, encoder, codec, seeded model, runtime, resume): a
    stage of :mod:`pretrain.runtime.loop`; a step is one optimizer step. Under ``torchrun`` one job over
    the ranks (FSDP2; rank 0 logs and writes grids and the export); raises ``ConfigError`` for a
    ``train.batch_size`` the data-parallel degree does not divide."""

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.ranks = ranks = JobRanks.start_batch_job(  # a no-op in one process
            cfg.parallel, cfg.train.batch_size,
            "the global micro-batch; each rank trains its contiguous share", Path(cfg.run_dir) / "flight_recorder")
        self.device = device = ranks.device if ranks.distributed else resolve_device(cfg.train.device)
        configure_host(cfg.train, device)
        self.run = run = Path(cfg.run_dir) / "pretrain"
        run.mkdir(parents=True, exist_ok=True)
        encoder = text_encoder_from_config(cfg.text_encoder)
        self.train_set, self.held = build_datasets(cfg.data, encoder)
        self.null = encoder.encode([""]).to(device)
        self.codec = build_codec(cfg.codec, device=str(device))
        attach_codec(self.codec, self.train_set, self.held, encoder=encoder)
        require_codec(self.train_set, self.codec)
        size = cfg.data.size // self.codec.downsample
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(cfg.train.seed, "init"))  # weights depend on the seed only
            self.model = model = build_backbone(cfg.model, size, self.codec.channels, encoder.dim,
                                                encoder.pooled_dim).to(device)
        n_params = count_parameters(model)
        try:  # e.g. flow.objective epsilon on a model without discrete training timesteps
            self.train_sigmas = objective_sigmas(model, cfg.flow)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        ranks.shard(model, None, cfg.parallel, low_precision=cfg.train.low_precision)
        self.sampler = sampler_for(self.train_set, cfg.train.seed, cfg.data.shuffle_buffer, cfg.train.batch_size)
        self.feed = BatchFeed(self.train_set, self.sampler, cfg.train.batch_size,
                              ranks.share(cfg.train.batch_size), workers=cfg.data.workers, prefetch=cfg.data.prefetch,
                              pin=device.type == "cuda")
        self.rt = rt = Runtime(model, cfg.train, cfg.optim, device, run / "checkpoints", cfg.checkpoint.keep_last,
                               stateful={"sampler": self.sampler}, shape=ranks.model_parallel_shape())
        resumed = rt.start(cfg.checkpoint.resume)
        if ranks.is_main:  # once the start is accepted: a refused resume writes nothing
            record_config(cfg, run, cfg.checkpoint.resume)
        self.profiler = StepProfiler(cfg.profile, run / "profile")
        self.logger = logger = MetricsLogger(run, cfg.train.steps, rt.step, cfg.wandb, asdict(cfg),
                                             ("loss", "heldout_loss"), enabled=ranks.is_main)
        logger.write(f"model: {n_params / 1e6:.2f} M params; data: {len(self.train_set)} train / "
                     f"{len(self.held)} held-out; device {device}; precision {cfg.train.precision}"
                     + (f"; resumed from {resumed}" if resumed else ""))
        logger.write(batch_arithmetic(cfg.train, len(self.train_set), ranks.dp_size) + f"; ranks: {ranks.layout()}")
        if rt.step == 0:
            logger.log(0, {"heldout_loss": self.heldout(model)}, advance=False)

    @property
    def step(self) -> int:
        return self.rt.step

    def heldout(self, model) -> float:
        """The held-out flow-matching loss on fixed draws."""
        cfg = self.cfg
        return heldout_loss(model, self.codec, self.held, self.null, cfg.flow, seed=cfg.train.seed,
                            num_samples=cfg.eval.heldout_samples, device=self.device)

    def train_step(self) -> dict:
        metrics = train_step(self.model, self.rt, self.feed, self.codec, null=self.null,
                             cfg=self.cfg, device=self.device, ranks=self.ranks, train_sigmas=self.train_sigmas)
        if metrics["nonfinite"]:
            self.logger.write(f"step {self.rt.step}: non-finite {metrics['nonfinite']}, optimizer step skipped "
                              f"({metrics['nonfinite_total']} so far)")
        return metrics

    def evaluate(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """The held-out loss every ``eval.every`` steps and a grid every ``eval.grid_every`` steps (and at the end)."""
        e, out, media = self.cfg.eval, {}, []
        with self.rt.sampling_model() as sampling:
            sampling.eval()
            if e.every and (step % e.every == 0 or last):
                out["heldout_loss"] = self.heldout(sampling)
            if e.grid_every and (step % e.grid_every == 0 or last):
                grid = self.ranks.write_on_main(lambda root: write_grid(
                    sampling, self.codec, self.held, self.null, num_prompts=e.grid_prompts, seed=self.cfg.train.seed,
                    num_inference_steps=e.num_inference_steps, guidance_scale=e.guidance_scale, shift=e.shift,
                    device=self.device, path=root / "samples" / f"heldout_step_{step:06d}.png"), self.run)
                media.append(grid)
        return out, media

    def save(self) -> Path | None:
        return self.rt.save()

    def finish(self) -> Path:
        cfg, run = self.cfg, self.run
        self.feed.close()  # the loader's workers end with the training
        sampling_meta = {"num_inference_steps": cfg.eval.num_inference_steps,
                         "guidance_scale": cfg.eval.guidance_scale, "shift": cfg.eval.shift}
        with self.rt.sampling_model() as sampling:
            out = self.ranks.export_on_main(lambda m: export_model(m.transformer, run / "export", ExportMeta(
                cfg.text_encoder, cfg.codec, cfg.data.size, sampling_meta, cfg.model.arch, asdict(cfg.data),
                m.export_settings(), cfg.flow.objective)), sampling.eval(), run / "export")
        self.logger.write(f"exported {out}")
        self.logger.close()
        return out


def train(cfg: PretrainConfig) -> Path:
    """Run pretraining (resuming when ``checkpoint.resume`` is set); returns the export folder."""
    return run_stage(PretrainRun(cfg))
