"""The pre-training loss as a regulariser of post-training: the export's own flow-matching objective on
the train split's images, added to the stage's loss with a weight.

ReFL alternates it with the reward loss (ImageReward, Xu et al. 2023, arXiv 2304.05977, Algorithm 1);
InstructGPT adds it to PPO's objective as "PPO-ptx" (Ouyang et al. 2022, arXiv 2203.02155, eq. 2:
gamma * E_{x ~ D_pretrain}[log pi(x)]). Here the two are summed in one backward, so the gradient of an
optimizer step is the stage's loss plus ``weight`` times the flow-matching loss. It pulls the policy back
to the data's images, where a reward's adversarial textures are absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.config import require_positive
from pretrain.objective import FlowConfig, draw_training_noise, objective_sigmas, pretrain_loss


@dataclass
class DataLossConfig:
    """``weight`` (0: off) times the export's flow-matching objective on train images at sigmas drawn
    from logit-normal(``logit_mean``, ``logit_std``) with ``shift`` (an export trained with a discrete
    objective draws its training timesteps instead, and these three are unused), always conditioned (no
    prompt dropout). Which images: the reward-gradient stage takes the step's prompts' own images; GRPO
    draws ``batch_size`` train images per mini-batch (null: the mini-batch's size,
    ``train.batch_size``)."""

    weight: float = 0.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    batch_size: int | None = None

    def validate(self, prefix: str = "") -> None:
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"{prefix}weight: must be a finite number >= 0, got {self.weight}")
        require_positive(self, prefix, "logit_std", "shift")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"{prefix}batch_size: must be a positive integer or null, got {self.batch_size}")

    def flow(self, objective: str) -> FlowConfig:
        return FlowConfig(self.logit_mean, self.logit_std, self.shift, cond_dropout=0.0, objective=objective)


class DataLoss:
    """The pre-training loss of ``cfg`` over the stage ``st`` (a :class:`posttrain.base.stage.PolicyStage`:
    its train split, codec, null prompt and export metadata); the noise and sigma of each image are drawn
    from the generator (``seed``, "data_loss", ``step``, key), so N ranks that each take their share of the
    keys draw what one process draws."""

    def __init__(self, cfg: DataLossConfig, st, seed: int):
        self.cfg, self.st, self.seed = cfg, st, seed
        self.flow = cfg.flow(st.meta.get("objective", "rectified_flow"))

    def __call__(self, model, idx: list[int], step: int, keys: list[int], autocast) -> torch.Tensor:
        """float32 scalar: the mean flow-matching loss of ``model`` on the train images ``idx`` (their
        captions' embeddings as the condition), image i's draws keyed by ``keys[i]``; ``autocast`` the
        runtime's context factory. Unweighted (the caller multiplies by ``cfg.weight``)."""
        st = self.st
        images, embeds, _ = st.train_set.batch(idx)
        x0 = st.codec.encode(images.to(st.device))
        noise, sigma, drop = draw_training_noise(x0, self.seed, step, keys, self.flow, "data_loss",
                                                 objective_sigmas(model, self.flow, "data_loss"))
        with autocast():
            return pretrain_loss(model, x0, embeds.to(st.device), st.null, noise, sigma, drop, self.flow.objective)
