"""`posttrain train-reward CONFIG`: train a small reward model and save it as a folder a reward loads.

``objective: contrastive`` (default): the ``learned_clip`` model (rewards/learned_clip.py), contrastively
on the emoji training split (optionally one hash half of it, ``data.train_half``); reports held-out
image->text retrieval top-1 / top-5. ``objective: judge``: the ``learned_judge`` stand-in
(rewards/learned_judge.py) regressed on an exact judge's scores of rendered and generated images
(:mod:`posttrain.tools.train_judge`); reports its agreement with the judge on held-out prompts.

Outputs under ``out_dir`` (in a pipeline, ``<run_dir>/train-reward``): ``model/`` (config.json +
model.safetensors), ``metrics.jsonl`` (one object per epoch, ``step`` = epoch), ``metrics.json`` (final),
``config.yaml`` (resolved).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.config import require_positive, save_config
from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.seeding import generator_for
from pretrain.text_encoder import NoTextEmbeds
from rewards.learned_clip import CAPTIONS, ClipNet, LearnedClipConfig, TextFeatures, contrastive_loss, save_learned_clip

log = logging.getLogger(__name__)


@dataclass
class RewardTrainSection:
    """AdamW (``lr``, ``weight_decay``; linear warm-up over ``warmup_frac`` of the steps, then cosine
    decay to 0) for ``epochs`` over shuffled batches of ``batch_size`` pairs (for ``objective:
    contrastive``, the InfoNCE negatives). Augmentation of each image: a random translation of up to
    ``shift`` px (edge pixels repeated) and Gaussian noise of std ``noise``. ``eval_every`` epochs: the
    held-out metric is logged (retrieval, or the Pearson r with the judge)."""

    epochs: int = 40
    batch_size: int = 256
    lr: float = 2.0e-3
    weight_decay: float = 0.05
    warmup_frac: float = 0.05
    shift: int = 2
    noise: float = 0.03
    seed: int = 0
    threads: int = 2
    eval_every: int = 10

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "epochs", "batch_size", "threads", "eval_every")
        if self.batch_size < 2:
            raise ValueError(f"{prefix}batch_size: must be >= 2 (the contrastive negatives), got {self.batch_size}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"{prefix}lr: must be a finite number > 0, got {self.lr}")
        if self.shift < 0 or self.noise < 0:
            raise ValueError(f"{prefix}shift/noise: must be >= 0, got {self.shift}/{self.noise}")


#: objective -> "module:function" training a reward model from a TrainRewardConfig.
OBJECTIVES = {"contrastive": "posttrain.tools.train_reward:train_contrastive",
              "judge": "posttrain.tools.train_judge:train_judge"}


@dataclass
class JudgeTargetSection:
    """``objective: judge``: what the stand-in learns from. ``reward``: the exact judge, a registered
    reward whose score of an (image, caption) pair, in [0, 1], is the target (``shapes``: the partial
    score). ``mismatched``: captions per training render besides its own, drawn from the other training
    captions (the judge scores these graded negatives too). ``generated_from``: an export folder whose ODE
    samples are added: ``generated`` images on training captions and ``heldout_generated`` on the
    held-out prompts (for the report only), ``num_inference_steps`` steps at ``guidance_scale``, noise
    from ``seed``, ``batch_size`` per sampling call. ``init_from``: a ``learned_judge`` folder to start
    from instead of random weights (its ``model`` block must equal this config's): a stand-in refreshed
    on the samples of a model post-trained against it, as RLHF retrains its reward model on the current
    policy's samples (Ouyang et al. 2022; Touvron et al. 2023, Llama 2, section 3.2.2)."""

    reward: str = "shapes"
    mismatched: int = 1
    generated_from: str | None = None
    generated: int = 1024
    heldout_generated: int = 192
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    seed: int = 0
    batch_size: int = 64
    init_from: str | None = None

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "num_inference_steps", "batch_size")
        if self.mismatched < 0 or self.generated < 0 or self.heldout_generated < 0:
            raise ValueError(f"{prefix}mismatched/generated/heldout_generated: must be >= 0, got "
                             f"{self.mismatched}/{self.generated}/{self.heldout_generated}")


@dataclass
class TrainRewardConfig:
    """``out_dir``: where the model folder and metrics go; ``run_dir``: set by a pipeline, which puts them
    in ``<run_dir>/train-reward`` instead (:meth:`folder`); ``objective``: a key of :data:`OBJECTIVES`;
    ``data``: the project's dataset config (``train_half`` picks a half of the train emoji); ``model``:
    the towers' architecture; ``judge``: the targets of ``objective: judge``."""

    out_dir: str = "runs/reward/learned_clip"
    run_dir: str | None = None
    objective: str = "contrastive"
    data: DataConfig = field(default_factory=DataConfig)
    model: LearnedClipConfig = field(default_factory=LearnedClipConfig)
    train: RewardTrainSection = field(default_factory=RewardTrainSection)
    judge: JudgeTargetSection = field(default_factory=JudgeTargetSection)

    def validate(self, prefix: str = "") -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"{prefix}objective: unknown '{self.objective}' (known: {', '.join(OBJECTIVES)})")
        if self.data.train_half not in (None, 0, 1):
            raise ValueError(f"{prefix}data.train_half: must be 0, 1 or null, got {self.data.train_half}")
        require_positive(self.model, f"{prefix}model.", "image_size", "width", "embed_dim", "text_max_length")
        if self.model.width % 8:
            raise ValueError(f"{prefix}model.width: must be a multiple of 8 (GroupNorm groups), got {self.model.width}")

    def folder(self) -> Path:
        """Where the outputs go: ``<run_dir>/train-reward`` when ``run_dir`` is set, else ``out_dir``."""
        return Path(self.run_dir) / "train-reward" if self.run_dir else Path(self.out_dir)


@torch.no_grad()
def retrieval(net: ClipNet, images: torch.Tensor, features: torch.Tensor, captions: list[str],
              ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Image->text retrieval among the set's distinct captions: ``{"top1": f, "top5": f, "n": N,
    "chance_top1": 1/M}``; an image counts as retrieved at k when its own caption is among the k most
    similar. ``images`` float ``[N, 3, H, W]`` in [0, 1], ``features`` MiniLM ``[N, 384]``."""
    net.eval()
    unique = sorted(set(captions))
    pick = [captions.index(c) for c in unique]
    target = torch.tensor([unique.index(c) for c in captions])
    img = torch.cat([net.image_embeds(images[i:i + 512]) for i in range(0, len(images), 512)])
    sims = img @ net.text_embeds(features[pick]).T  # [N, M]
    rank = (sims > sims.gather(1, target[:, None])).sum(1)  # 0 = best
    out = {f"top{k}": float((rank < k).float().mean()) for k in ks}
    return {**out, "n": len(captions), "chance_top1": 1.0 / len(unique)}


def augment(x: torch.Tensor, shift: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """Random translation (replicate padding, one offset per image) and Gaussian noise; clamped to [0, 1]."""
    if shift:
        n, _, h, w = x.shape
        pad = F.pad(x, (shift,) * 4, mode="replicate")
        dy, dx = (torch.randint(0, 2 * shift + 1, (2, n), generator=gen)).tolist()
        x = torch.stack([pad[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    if noise:
        x = x + noise * torch.randn(x.shape, generator=gen)
    return x.clamp(0, 1)


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def fit(net: torch.nn.Module, images: torch.Tensor, cfg: RewardTrainSection, loss_fn, on_epoch=None) -> list[float]:
    """Train ``net`` in place over ``images`` (float ``[N, 3, H, W]`` in [0, 1]) in shuffled full batches,
    each augmented (:func:`augment`); ``loss_fn(net, x, idx)`` is the loss of the augmented batch ``x``
    whose rows are ``idx`` (e.g. the contrastive loss against ``features[idx]``). Returns the mean loss of
    each epoch; ``on_epoch(epoch, loss)`` is called after each."""
    torch.manual_seed(cfg.seed)
    n = images.shape[0]
    bs = min(cfg.batch_size, n)
    per_epoch = max(1, n // bs)
    total = cfg.epochs * per_epoch
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, total, int(cfg.warmup_frac * total)))
    losses = []
    for epoch in range(cfg.epochs):
        net.train()
        gen = generator_for(cfg.seed, "shuffle", epoch)
        perm = torch.randperm(n, generator=gen)
        acc = 0.0
        for b in range(per_epoch):  # full batches only: every batch has bs - 1 negatives per pair
            idx = perm[b * bs:(b + 1) * bs]
            loss = loss_fn(net, augment(images[idx], cfg.shift, cfg.noise, gen), idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += float(loss.detach())
        losses.append(acc / per_epoch)
        if on_epoch:
            on_epoch(epoch, losses[-1])
    net.eval()
    return losses


def train_reward(cfg: TrainRewardConfig) -> dict:
    """Train the reward model of ``cfg.objective`` (:data:`OBJECTIVES`), evaluate and save it; returns its
    final metrics (also written to ``metrics.json`` in ``cfg.folder()``)."""
    module, _, name = OBJECTIVES[cfg.objective].partition(":")
    return getattr(importlib.import_module(module), name)(cfg)


def train_reward_stage(cfg: TrainRewardConfig) -> Path:
    """The ``train-reward`` stage (`posttrain train-reward`, or a pipeline's): :func:`train_reward`, its
    final metrics printed as JSON; returns the reward model's folder (``<folder>/model``)."""
    metrics = train_reward(cfg)
    print(json.dumps(metrics, indent=2), flush=True)
    return cfg.folder() / "model"


def train_contrastive(cfg: TrainRewardConfig) -> dict:
    """``objective: contrastive``: train, evaluate and save; returns the final metrics (also written to
    ``metrics.json`` in ``cfg.folder()``):
    ``heldout`` and ``train`` retrieval dicts (see ``retrieval``), ``loss_first``/``loss_last``,
    ``seconds``, ``model`` (the saved folder)."""
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.train.threads)
    out = cfg.folder()
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    train, held = build_datasets(cfg.data, NoTextEmbeds())
    text = TextFeatures(cfg.model.text_path, cfg.model.text_max_length)
    tr_x, tr_f = train.images.float() / 255, text(train.captions)
    he_x, he_f = held.images.float() / 255, text(held.captions)
    torch.manual_seed(cfg.train.seed)
    net = ClipNet(cfg.model, text.dim)
    log.info("learned_clip: %d train / %d held-out pairs (train_half=%s), %.2f M trainable params", len(train),
             len(held), cfg.data.train_half, sum(p.numel() for p in net.parameters()) / 1e6)
    lines = open(out / "metrics.jsonl", "w")

    def on_epoch(epoch, loss):
        row = {"step": epoch + 1, "epoch": epoch + 1, "loss": loss, "temperature": float(1 / net.scale().detach())}
        if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
            row["heldout"] = retrieval(net, he_x, he_f, held.captions)
            net.train()
        lines.write(json.dumps(row) + "\n")
        lines.flush()
        log.info("epoch %d: %s", epoch + 1, row)

    losses = fit(net, tr_x, cfg.train, lambda net, x, idx: contrastive_loss(
        net.image_embeds(x), net.text_embeds(tr_f[idx]), net.scale()), on_epoch)
    lines.close()
    sub = torch.arange(0, len(train), max(1, len(train) // 512))[:512]  # a train subset of held-out size scale
    metrics = {"heldout": retrieval(net, he_x, he_f, held.captions),
               "train": retrieval(net, tr_x[sub], tr_f[sub], [train.captions[i] for i in sub.tolist()]),
               "loss_first": losses[0], "loss_last": losses[-1], "train_pairs": len(train),
               "model": str(save_learned_clip(net, out / "model")), "seconds": time.perf_counter() - t0}
    # the caption bank of learned_clip_contrastive: the distinct training captions
    (out / "model" / CAPTIONS).write_text("\n".join(dict.fromkeys(train.captions)) + "\n")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
