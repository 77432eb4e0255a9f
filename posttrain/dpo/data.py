"""Preference pairs for Diffusion-DPO: offline (Pick-a-Pic schema) and online (sampled and scored).

Pick-a-Pic schema (Kirstain et al. 2023): ``caption``, ``jpg_0``, ``jpg_1`` (encoded image bytes, or
a path relative to the data file), ``label_0`` (1: jpg_0 preferred, 0: jpg_1 preferred, 0.5: tie).
Read from a local parquet file, a jsonl file, or a folder holding ``pairs.jsonl`` (or ``*.parquet``)
with Hugging Face ``datasets``. A malformed row is skipped and counted; ties are dropped or kept with
preference probability 0.5 (a symmetric loss) by config.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from posttrain.base.signal_guard import NoSignalError, nonfinite_counts
from pretrain.codec import decode_conditions
from pretrain.data.folder import DatasetError
from pretrain.parallel.data import gather_samples
from pretrain.sampling import initial_noise, sample_latents
from pretrain.text_encoder import PromptEmbeds

log = logging.getLogger(__name__)


@dataclass
class PairSet:
    """``images_w`` / ``images_l``: float32 ``[P, 3, H, W]`` in [0, 1] (winner, loser); ``captions``;
    ``embeds`` ``[P, ...]``; ``pref`` float32 ``[P]``: probability that ``images_w`` is preferred
    (1, or 0.5 for a kept tie)."""

    images_w: torch.Tensor
    images_l: torch.Tensor
    captions: list[str]
    embeds: PromptEmbeds
    pref: torch.Tensor

    def __len__(self) -> int:
        return len(self.captions)

    def select(self, idx: list[int]) -> "PairSet":
        t = torch.as_tensor(idx, dtype=torch.long)
        return PairSet(self.images_w[t], self.images_l[t], [self.captions[i] for i in idx], self.embeds[t],
                       self.pref[t])


def _decode(value, root: Path, size: int) -> np.ndarray:
    from PIL import Image

    if isinstance(value, dict):  # datasets' Image feature / parquet struct {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    src = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else root / str(value)
    with Image.open(src) as im:
        im.load()
        rgba = im.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB").resize((size, size), Image.LANCZOS))


def _data_files(path: Path) -> tuple[str, list[str]]:
    if path.is_dir():
        parquet = sorted(str(p) for p in path.glob("*.parquet"))
        if parquet:
            return "parquet", parquet
        if (path / "pairs.jsonl").is_file():
            return "json", [str(path / "pairs.jsonl")]
        raise DatasetError(f"{path}: no *.parquet and no pairs.jsonl (Pick-a-Pic schema expected)")
    if not path.is_file():
        raise DatasetError(f"{path}: preference data not found")
    return ("parquet" if path.suffix == ".parquet" else "json"), [str(path)]


def load_preference_pairs(path: str | Path, size: int, ties: str = "drop", limit: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor, dict[str, list[str]]]:
    """Read Pick-a-Pic-schema pairs. Returns (winners uint8 ``[P, 3, size, size]``, losers, captions,
    preference probabilities ``[P]`` (1, or 0.5 for ties), skipped {reason: [row ids]}). ``ties``:
    "drop" or "half" (keep with probability 0.5). Raises
    ``DatasetError`` naming the file if nothing usable remains."""
    from PIL import Image

    from pretrain.extras import require

    load_dataset = require("datasets", "offline DPO pairs (offline.path)").load_dataset

    if ties not in ("drop", "half"):
        raise DatasetError(f"offline.ties: '{ties}' must be 'drop' or 'half'")
    path = Path(path)
    kind, files = _data_files(path)
    root = path if path.is_dir() else path.parent
    rows = load_dataset(kind, data_files=files, split="train")
    win, lose, caps, weights = [], [], [], []
    skipped: dict[str, list[str]] = {}
    for i, row in enumerate(rows):
        if limit is not None and len(caps) >= limit:
            break
        rid = f"row {i}"
        caption = str(row.get("caption") or "").strip()
        label = row.get("label_0")
        if not caption:
            skipped.setdefault("empty caption", []).append(rid)
            continue
        if label not in (0, 0.5, 1):
            skipped.setdefault("label_0 not in {0, 0.5, 1}", []).append(rid)
            continue
        if label == 0.5 and ties == "drop":
            skipped.setdefault("tie (offline.ties=drop)", []).append(rid)
            continue
        try:
            a, b = _decode(row["jpg_0"], root, size), _decode(row["jpg_1"], root, size)
        except (KeyError, OSError, ValueError, TypeError, Image.DecompressionBombError):
            skipped.setdefault("missing or unreadable image", []).append(rid)
            continue
        w, lo = (a, b) if label >= 0.5 else (b, a)
        win.append(w)
        lose.append(lo)
        caps.append(caption)
        weights.append(0.5 if label == 0.5 else 1.0)
    for reason, ids in skipped.items():
        log.warning("%s: skipped %d pair(s): %s (first: %s)", path, len(ids), reason, ids[:5])
    if not caps:
        raise DatasetError(f"{path}: no usable preference pair (skipped: { {k: len(v) for k, v in skipped.items()} })")

    def stack(x):
        return torch.from_numpy(np.stack(x)).permute(0, 3, 1, 2).contiguous()

    return stack(win), stack(lose), caps, torch.tensor(weights), skipped


@torch.no_grad()
def online_pairs(model, codec, prompts, prompt_idx: list[int], *, online, reward_fn, null: PromptEmbeds, shift: float,
                 seed: int, round_: int, device, batch_size: int = 64, ranks=None) -> tuple[PairSet | None, dict]:
    """Sample ``online.samples_per_prompt`` images per prompt with the current model (ODE with
    ``online.num_inference_steps`` and ``online.guidance_scale``, seeds keyed by (seed, "rollout", round,
    global index)), score them with ``reward_fn(images, prompts, metadata) -> (total, raw)`` (``metadata``:
    ``source_images``, each sample's conditioning image decoded, when the prompts carry them; else None)
    and pair each prompt's
    best against its worst when their gap exceeds ``online.margin`` (``online``: the ``online:`` block,
    :class:`posttrain.dpo.stage.OnlineConfig`). With ``ranks`` (a :class:`pretrain.parallel.job.JobRanks`
    under torchrun) each data-parallel rank samples and scores its contiguous share of the prompts (its
    ``ranks.share``; the data-parallel degree must divide ``len(prompt_idx)``), the rewards and each
    prompt's best and worst images are all-gathered, so every rank returns the pairs one process makes.
    Returns the pairs (None if none qualify) and stats (reward mean, pairs kept, mean gap). Raises
    :class:`posttrain.base.signal_guard.NoSignalError` when no sample has a finite reward."""
    k, margin = online.samples_per_prompt, online.margin
    n = len(prompt_idx) * k
    start, stop = ranks.share(len(prompt_idx)) if ranks is not None else (0, len(prompt_idx))
    noise = initial_noise(n, codec.latent_shape(*prompts.images.shape[-2:]), seed, step=round_, stream="rollout",
                          device=device)[start * k:stop * k]
    rows = [prompt_idx[i // k] for i in range(start * k, stop * k)]
    images, sources = [], []
    for s in range(0, len(rows), batch_size):
        _, embeds, _ = prompts.batch(rows[s:s + batch_size])
        lat = sample_latents(model, embeds.to(device), null, noise[s:s + batch_size], online.num_inference_steps,
                             online.guidance_scale, shift)
        images.append(codec.decode(lat).cpu())
        if embeds.images is not None:  # an edit's source, read by rewards as GRPO's rollouts give it
            sources.append(decode_conditions(codec, embeds.images).cpu().float())
    images = torch.cat(images)
    _, _, captions = prompts.batch(rows)
    total, raw = reward_fn(images, captions, {"source_images": torch.cat(sources)} if sources else None)
    group = ranks.mesh.dp_group if ranks is not None and ranks.distributed else None
    total = gather_samples(total.float().cpu(), group)  # every prompt's rewards, in prompt order
    raw = {name: gather_samples(v.float().cpu(), group) for name, v in raw.items()}
    finite = torch.isfinite(total)
    if not bool(finite.any()):
        raise NoSignalError(f"online round {round_}: no sample has a finite reward ("
                            + ", ".join(f"{k}: {c} of {n} non-finite" for k, c in nonfinite_counts(raw).items())
                            + "); stopping. The last complete checkpoint is intact.")
    total = torch.where(finite, total, torch.full_like(total, float("nan")))  # inf is "not applicable" too
    r = total.view(len(prompt_idx), k)
    best, worst = r.nan_to_num(-float("inf")).argmax(1), r.nan_to_num(float("inf")).argmin(1)
    gap = r.gather(1, best[:, None]).squeeze(1) - r.gather(1, worst[:, None]).squeeze(1)
    keep = (gap > margin).nonzero().flatten().tolist()
    stats = {"online_reward_mean": float(total[finite].mean()), "online_pairs": len(keep),
             "online_gap_mean": float(gap[torch.isfinite(gap)].mean()) if torch.isfinite(gap).any() else float("nan")}
    if not keep:
        return None, stats
    local = torch.arange(start, stop)  # this rank's prompts: their best and worst images, then everyone's
    images_w = gather_samples(images[(local - start) * k + best[local]], group)
    images_l = gather_samples(images[(local - start) * k + worst[local]], group)
    _, embeds, caps = prompts.batch([prompt_idx[p] for p in keep])
    return PairSet(images_w[keep], images_l[keep], caps, embeds, torch.ones(len(keep))), stats
