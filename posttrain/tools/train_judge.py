"""``posttrain train-reward`` with ``objective: judge``: the ``learned_judge`` stand-in
(:mod:`rewards.learned_judge`) regressed on an exact judge's scores.

Training pairs: every training render with its own caption and ``judge.mismatched`` other training
captions (the judge's partial score of a render against another caption is graded: the right shape in
the wrong colour scores in between), plus, with ``judge.generated_from``, ODE samples of that export on
training captions with the judge's scores of them (the images a policy starts from). Loss: binary
cross-entropy of the predicted score against the judge's score as a soft target.

Metrics (``metrics.json``): for held-out renders (own and mismatched captions) and, with an export,
held-out generated images: the Pearson correlation of the stand-in's score with the judge's, the mean
absolute error, and both means; on the shapes task, ``contrast_order``: per kind of one-requirement edit
of a caption (a colour, shape, count, relation, object order or binding), how often the stand-in ranks
the image's own caption against the edited one as the judge does (0.5: blind to that requirement).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.config import save_config
from pretrain.data import shapes as shapes_grammar
from pretrain.data.dataset import build_datasets
from pretrain.text_encoder import NoTextEmbeds
from rewards.base import build_reward
from rewards.learned_clip import TextFeatures
from rewards.learned_judge import JudgeNet, load_learned_judge, save_learned_judge
from posttrain.tools.train_reward import TrainRewardConfig, fit

log = logging.getLogger(__name__)


def with_mismatched(n: int, captions: list[str], pool: list[str], k: int, seed: int) -> tuple[list[int], list[str]]:
    """Pairs (image index, caption): each of ``n`` images with its own ``captions[i]``, then up to ``k``
    captions drawn from ``pool`` that differ from it (seeded; fewer only when the draws keep hitting its
    own), in image order."""
    gen = torch.Generator().manual_seed(seed)
    idx, caps = [], []
    for i in range(n):
        idx.append(i)
        caps.append(captions[i])
        draws = torch.randint(len(pool), (4 * k + 4,), generator=gen).tolist()
        others = [pool[j] for j in draws if pool[j] != captions[i]][:k]
        idx += [i] * len(others)
        caps += others
    return idx, caps


@torch.no_grad()
def sample_export(export: str, prompts: list[str], cfg, seed: int) -> torch.Tensor:
    """ODE samples of the export folder ``export``, one per prompt (the evaluation's sampler,
    :func:`posttrain.eval.evaluate.paired_samples`, noise from ``seed``): float32 ``[N, 3, H, W]`` in
    [0, 1]. ``FileNotFoundError`` naming ``judge.generated_from`` when it is not an export."""
    from posttrain.eval.evaluate import EvalConfig, paired_samples
    from pretrain.export import META, load_exported

    if not (Path(export) / META).is_file():
        raise FileNotFoundError(f"judge.generated_from: '{export}' is not an export folder (no {META}; "
                                f"run the pretrain stage first)")
    model, encoder, codec, meta = load_exported(export)
    model.eval()
    log.info("learned_judge: sampling %d images from %s", len(prompts), export)
    sampling = EvalConfig(rewards=[], samples_per_prompt=1, seed=seed, num_inference_steps=cfg.num_inference_steps,
                          guidance_scale=cfg.guidance_scale, batch_size=cfg.batch_size)
    images = paired_samples(model, codec, encoder.encode(prompts), encoder.encode([""]), sampling,
                            image_size=meta["image_size"], shift=meta["sampling"]["shift"], device="cpu")
    return images.float().clamp(0, 1)


def agreement(pred: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """``{"pearson", "mae", "mean_pred", "mean_judge", "n"}`` of predicted against judged scores ``[N]``."""
    p, t = pred.double(), target.double()
    r = torch.corrcoef(torch.stack([p, t]))[0, 1] if len(p) > 1 else torch.tensor(float("nan"))
    return {"pearson": float(r), "mae": float((p - t).abs().mean()), "mean_pred": float(p.mean()),
            "mean_judge": float(t.mean()), "n": len(p)}


@torch.no_grad()
def predict(net: JudgeNet, images: torch.Tensor, features: torch.Tensor, batch: int = 512) -> torch.Tensor:
    net.eval()
    return torch.cat([torch.sigmoid(net.logits(images[i:i + batch], features[i:i + batch]))
                      for i in range(0, len(images), batch)])


def contrast_order(net: JudgeNet, text: TextFeatures, images: torch.Tensor, captions: list[str], judge) -> dict:
    """How often the stand-in ranks an image's own caption against each of its caption's minimal edits
    (:func:`pretrain.data.shapes.minimal_edits`) the way the exact ``judge`` does, over the (image, edit)
    pairs the judge does not tie: ``{"all": fraction, "pairs": n, "<kind>": fraction, ...}`` per edit kind
    with such pairs. 0.5 is a stand-in blind to the edited requirement. ``images``: float ``[N, 3, H, W]``
    in [0, 1] or uint8 ``[N, 3, H, W]``; ``captions``: shapes captions (``KeyError`` naming one that is
    not)."""
    idx, own, edit, kinds = [], [], [], []
    for i, c in enumerate(captions):
        for kind, specs in shapes_grammar.minimal_edits(shapes_grammar.spec_for_caption(c)).items():
            for e in specs:
                idx.append(i), own.append(c), edit.append(e.caption), kinds.append(kind)
    x = images[torch.as_tensor(idx)]
    x = x.float() / 255 if x.dtype == torch.uint8 else x
    gap_judge = judge(x, own, None).float() - judge(x, edit, None).float()
    gap_pred = predict(net, x, text(own)) - predict(net, x, text(edit))
    keep = gap_judge != 0
    right = (gap_pred > 0) == (gap_judge > 0)
    out = {"all": float(right[keep].float().mean()), "pairs": int(keep.sum())}
    for kind in shapes_grammar.EDIT_KINDS:
        sel = keep & torch.tensor([k == kind for k in kinds])
        if sel.any():
            out[kind] = float(right[sel].float().mean())
    return out


def start_from(folder: str, cfg: TrainRewardConfig) -> JudgeNet:
    """The trainable :class:`JudgeNet` saved in ``folder`` (``judge.init_from``). ``FileNotFoundError``
    naming the key for a missing folder, ``ValueError`` naming it when the folder's ``model`` block
    differs from ``cfg.model`` (another architecture or text encoder)."""
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"judge.init_from: '{folder}' is not a learned_judge folder (no config.json; "
                                f"run train-reward first)")
    net = load_learned_judge(folder)
    if net.cfg != cfg.model:
        raise ValueError(f"judge.init_from: the model in '{folder}' ({net.cfg}) differs from this config's "
                         f"model block ({cfg.model}); use the same block")
    return net.train().requires_grad_(True)


def train_judge(cfg: TrainRewardConfig) -> dict:
    """Build the pairs, score them with the judge, train and save the stand-in; returns the metrics (also
    in ``metrics.json`` of :meth:`TrainRewardConfig.folder`; the model folder under ``model``)."""
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.train.threads)
    out = cfg.folder()
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    jc = cfg.judge
    judge = build_reward(jc.reward)
    train, held = build_datasets(cfg.data, NoTextEmbeds())
    pool = sorted(set(train.captions))

    def pairs(images: torch.Tensor, captions: list[str], k: int, seed: int):
        idx, caps = with_mismatched(len(captions), captions, pool, k, seed)
        x = images[torch.as_tensor(idx)]
        x = x.float() / 255 if x.dtype == torch.uint8 else x
        return x, caps, judge(x, caps, None).float()

    sets = {"train": pairs(train.images, train.captions, jc.mismatched, jc.seed),
            "heldout_renders": pairs(held.images, held.captions, 1, jc.seed + 1)}
    if jc.generated_from:
        tr_prompts = [train.captions[i] for i in torch.randperm(len(train), generator=torch.Generator().manual_seed(
            jc.seed))[:jc.generated].tolist()]
        he_prompts = [held.captions[i % len(held)] for i in range(jc.heldout_generated)]
        size = train.images.shape[-1]  # samples of another resolution are resized to the renders'
        gen_tr, gen_he = (F.interpolate(sample_export(jc.generated_from, p, jc, seed), size=(size, size),
                                        mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)
                          for p, seed in ((tr_prompts, jc.seed), (he_prompts, jc.seed + 10_000_000)))
        sets["generated"] = (gen_tr, tr_prompts, judge(gen_tr, tr_prompts, None).float())
        sets["heldout_generated"] = (gen_he, he_prompts, judge(gen_he, he_prompts, None).float())
    fit_sets = [sets[k] for k in ("train", "generated") if k in sets]
    x = torch.cat([s[0] for s in fit_sets])
    caps = [c for s in fit_sets for c in s[1]]
    y = torch.cat([s[2] for s in fit_sets])
    text = TextFeatures(cfg.model.text_path, cfg.model.text_max_length)
    feats = text(caps)
    torch.manual_seed(cfg.train.seed)
    net = JudgeNet(cfg.model, text.dim) if not jc.init_from else start_from(jc.init_from, cfg)
    log.info("learned_judge: %d training pairs (mean judge score %.3f), %.2f M trainable params", len(y),
             float(y.mean()), sum(p.numel() for p in net.parameters()) / 1e6)
    report = {k: (s[0], text(s[1]), s[2]) for k, s in sets.items() if k.startswith("heldout")}
    lines = open(out / "metrics.jsonl", "w")

    def on_epoch(epoch, loss):
        row = {"step": epoch + 1, "epoch": epoch + 1, "loss": loss}
        if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
            row.update({k: agreement(predict(net, xi, fi), yi)["pearson"] for k, (xi, fi, yi) in report.items()})
            net.train()
        lines.write(json.dumps(row) + "\n")
        lines.flush()
        log.info("epoch %d: %s", epoch + 1, row)

    losses = fit(net, x, cfg.train, lambda net, xb, idx: F.binary_cross_entropy_with_logits(
        net.logits(xb, feats[idx]), y[idx]), on_epoch)
    lines.close()
    metrics = {k: agreement(predict(net, xi, fi), yi) for k, (xi, fi, yi) in report.items()}
    if cfg.data.source == "shapes":
        probe = {"heldout_renders": (held.images, held.captions)}
        if jc.generated_from:
            probe["heldout_generated"] = (gen_he, he_prompts)
        metrics["contrast_order"] = {k: contrast_order(net, text, *v, judge) for k, v in probe.items()}
    metrics.update({"loss_first": losses[0], "loss_last": losses[-1], "train_pairs": len(y),
                    "model": str(save_learned_judge(net, out / "model")), "seconds": time.perf_counter() - t0})
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
