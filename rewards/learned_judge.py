"""``learned_judge``: a small differentiable stand-in for an exact judge, trained on the judge's scores.

The real-world setup of post-training is a learned reward approximating something that cannot be
queried at scale (a person, a detector). On the shapes task the truth is known (:mod:`rewards.shapes`),
so a stand-in trained to predict the exact judge's partial score lets a run be trained on the learned
reward and judged by the exact one: learned reward up while exact accuracy falls is reward hacking,
measured rather than guessed at. The stand-in is differentiable in the image, so it is also a reward
whose truth is known for methods that back-propagate a reward.

Model: the ``learned_clip`` towers (:class:`rewards.learned_clip.ClipNet`: a conv image tower, frozen
MiniLM features with a trainable MLP head, both L2-normalised) and a calibrated score,
``sigmoid(scale * cos(image, prompt) + bias)`` in [0, 1], trained with binary cross-entropy against the
judge's partial score as a soft target (``posttrain train-reward`` with ``objective: judge``). On disk:
a ``learned_judge/1`` folder (``config.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import torch
from torch import nn

from rewards.base import register
from rewards.images import check_images
from rewards.learned_clip import ClipNet, LearnedClipConfig, load_learned_clip, save_learned_clip, shared_text_features
from pretrain.truncation import TruncationCounter

FORMAT = "learned_judge/1"


class JudgeNet(ClipNet):
    """``ClipNet`` with a bias: :meth:`logits` ``= scale * cos + bias``; ``scale`` is ``exp(logit_scale)``
    clamped to <= 100 as CLIP's."""

    def __init__(self, cfg: LearnedClipConfig, text_dim: int = 384):
        super().__init__(cfg, text_dim)
        self.bias = nn.Parameter(torch.zeros(()))

    def logits(self, images: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """float ``[B, 3, H, W]`` images in [0, 1] and MiniLM features ``[B, 384]`` -> float32 ``[B]``
        logits of the predicted score (differentiable in ``images``)."""
        cos = (self.image_embeds(images) * self.text_embeds(features)).sum(-1)
        return self.scale() * cos + self.bias


def save_learned_judge(net: JudgeNet, folder) -> object:
    """Write ``net`` as a ``learned_judge/1`` folder; returns the folder."""
    return save_learned_clip(net, folder, fmt=FORMAT)


def load_learned_judge(folder, device: str = "cpu") -> JudgeNet:
    """The frozen :class:`JudgeNet` in ``folder``. ``FileNotFoundError`` for a missing file,
    ``ValueError`` for another format (e.g. a ``learned_clip`` folder) or mismatching weights."""
    return load_learned_clip(folder, device, cls=JudgeNet, fmt=FORMAT)


@register("learned_judge")
class LearnedJudge:
    """The stand-in's predicted judge score, float32 ``[B]`` in [0, 1].

    Args: ``path``: a folder written by ``posttrain train-reward`` with ``objective: judge``; ``device``.
    Call: images float ``[B, 3, H, W]`` in [0, 1], ``B`` prompts (no gradient); :meth:`score` keeps the
    graph to the images. Prompts longer than the model's ``text_max_length`` tokens are cut and counted
    in ``truncation``. ``ValueError`` for a wrong shape or prompt count, ``FileNotFoundError`` for a
    missing folder or file."""

    reward_name = "learned_judge"
    differentiable = True

    def __init__(self, path: str, device: str = "cpu"):
        self.net = load_learned_judge(path, device)
        self.device = torch.device(device)
        self.text = shared_text_features(self.net.cfg.text_path, self.net.cfg.text_max_length, device)
        self.truncation = TruncationCounter(self.reward_name, self.net.cfg.text_max_length)

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """float32 ``[B]`` in [0, 1], differentiable in ``images`` (the weights are frozen)."""
        check_images(images, prompts, self.reward_name)
        self.truncation.check(prompts, self.text.token_counts(list(prompts)))
        features = self.text(list(prompts)).to(self.device)
        return torch.sigmoid(self.net.logits(images.to(self.device), features)).float()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.score(images, prompts).cpu()


@register("learned_judge_edit")
class LearnedJudgeEdit(LearnedJudge):
    """The shapes task's stand-in (:class:`LearnedJudge`) scoring an edit of the shapes editing task: each
    prompt ``"<source caption>; <instruction>"`` is looked up (:func:`pretrain.data.shapes.edit_for_prompt`,
    ``KeyError`` naming one outside the grammar) and the image scored against the edit's target caption, as
    the exact ``shapes_edit`` judge checks it. A differentiable reward for the editing task from a stand-in
    trained on text-to-image captions (``posttrain train-reward configs/reward/shapes_judge.yaml``); it sees
    the output only, not the source. float32 ``[B]`` in [0, 1]."""

    reward_name = "learned_judge_edit"

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        from pretrain.data.shapes import edit_for_prompt

        return super().score(images, [edit_for_prompt(p).target.caption for p in prompts])
