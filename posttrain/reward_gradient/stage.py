"""`posttrain reward_gradient`: fine-tune an export by back-propagating a differentiable reward through
its own sampling chain (DRaFT-K, DRaFT-LV, ReFL, AlignProp: :mod:`posttrain.objectives.reward_gradient`),
or by Adjoint Matching's regression onto the lean adjoint (:mod:`posttrain.objectives.adjoint_matching`).

A step: ``train.grad_accum`` micro-batches of ``train.batch_size`` prompts from the data's train split
(every rank draws the same, as midtraining), each sampled from seeded noise (keyed by (seed, step,
sample index)) with the family's Euler ODE at ``sampling.num_inference_steps`` and CFG
``sampling.guidance_scale``, decoded by the export's codec and scored by ``reward`` (one differentiable
reward: :func:`rewards.base.differentiable_reward`); the method decides which steps carry the gradient.
The policy is LoRA or full (``policy``). None of the back-propagating methods has a KL term to the start:
DRaFT and AlignProp rely on LoRA, few steps and early stopping, ReFL on a small learning rate and on the
pre-training loss (``data_loss``: ImageReward, Xu et al. 2023, Algorithm 1 alternates the ReFL loss with
the pre-training loss; here the two are summed, any method may use it); Adjoint
Matching's optimum is the base distribution tilted by exp(``reward_scale`` r), its KL-regularised
target, and it reads the start's velocity (LoRA: adapters off; full: a frozen copy). The ``guard`` block
(held-out flow-matching loss, independent judges) watches for the reward hacking they are prone to.
``method.checkpoint`` recomputes every gradient-carrying step's and the decoder's activations in the
backward pass (AlignProp's memory saving; any method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.base.data_loss import DataLoss, DataLossConfig
from posttrain.base.guard import Guard
from posttrain.base.run import PolicyRun
from posttrain.base.stage import PolicyStage, StageRanks
from posttrain.base.stage_config import StageConfig
from posttrain.objectives.adjoint_matching import adjoint_matching
from posttrain.objectives.reward_gradient import Chain, alignprop, draft_k, draft_lv, refl
from pretrain.config import require_positive
from pretrain.data.dataset import require_in_memory
from pretrain.data.sampler import EpochSampler
from pretrain.guidance import guided_velocity
from pretrain.registry import Registry
from pretrain.runtime.accumulate import Accumulation
from pretrain.runtime.loop import run_stage
from pretrain.sampling import initial_noise, sample_latents
from pretrain.seeding import generator_for, randn_per_sample
from rewards.base import differentiable_reward
from rewards.specs import parse_reward_specs

@dataclass(frozen=True)
class Method:
    """A registered method: ``run(chain, method config, generator) -> (loss, metrics)``;
    ``needs_reference``: it reads the start's velocity (``chain.base_velocity``)."""

    run: Callable
    needs_reference: bool = False


#: method name -> :class:`Method`; add yours with ``METHODS.register(name)(Method(...))``.
METHODS = Registry("reward-gradient method", {
    "draft_k": Method(lambda chain, m, g: draft_k(chain, m.k)),
    "draft_lv": Method(lambda chain, m, g: draft_lv(chain, m.n_noise, g)),
    "refl": Method(lambda chain, m, g: refl(chain, m.refl_last, g)),
    "alignprop": Method(lambda chain, m, g: alignprop(chain, m.k, g)),
    "adjoint_matching": Method(lambda chain, m, g: adjoint_matching(chain, m.k, m.reward_scale, g), True),
}, key="method.name")


@dataclass
class MethodConfig:
    """``name``: a :data:`METHODS` entry; ``k``: steps carrying the gradient (DRaFT-K; AlignProp's
    largest draw; Adjoint Matching's timesteps per loss); ``n_noise``: DRaFT-LV's re-noisings;
    ``refl_last``: ReFL draws its step from the last ``refl_last``; ``reward_scale``: Adjoint Matching's
    lambda (the target is p_base exp(lambda r)); ``checkpoint``: recompute activations in backward (less
    memory, ~one more forward per gradient step)."""

    name: str = "draft_k"
    k: int = 1
    n_noise: int = 2
    refl_last: int = 4
    reward_scale: float = 1.0
    checkpoint: bool = False

    def validate(self, prefix: str = "") -> None:
        METHODS.get(self.name, f"{prefix}name")
        require_positive(self, prefix, "k", "n_noise", "refl_last")


@dataclass
class SamplingConfig:
    """The chain the gradient runs through: ``num_inference_steps`` Euler steps, ``guidance_scale``,
    ``shift`` (null: the export's)."""

    num_inference_steps: int = 8
    guidance_scale: float = 4.0
    shift: float | None = None

    def validate(self, prefix: str = "") -> None:
        require_positive(self, prefix, "num_inference_steps")


@dataclass
class RewardGradientConfig(StageConfig):
    """`posttrain reward_gradient` config (the shared blocks: :class:`posttrain.base.stage_config.StageConfig`):
    ``reward``: ``{name: {param: value}}``, exactly one differentiable reward; ``method``:
    :class:`MethodConfig`; ``sampling``: :class:`SamplingConfig`; ``data_loss``: :class:`DataLossConfig`. A
    step is one optimizer step over ``train.grad_accum`` micro-batches of ``train.batch_size`` prompts.
    Outputs: ``<run_dir>/reward_gradient/``."""

    run_dir: str = "runs/reward_gradient"
    reward: dict[str, Any] = field(default_factory=dict)
    method: MethodConfig = field(default_factory=MethodConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data_loss: DataLossConfig = field(default_factory=DataLossConfig)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        require_in_memory(self.data, f"{prefix}data.", "the prompt sampling")
        if self.data_loss.batch_size is not None:
            raise ValueError(f"{prefix}data_loss.batch_size: the reward-gradient stage trains on its prompts' own "
                             f"images (train.batch_size of them); remove the key")
        specs = parse_reward_specs({k: {"weight": 1.0, **(v or {})} for k, v in self.reward.items()}, f"{prefix}reward")
        if len(specs) != 1:
            raise ValueError(f"{prefix}reward: exactly one differentiable reward, e.g. "
                             f"{{learned_judge: {{path: runs/reward/shapes_judge/model}}}}; got {sorted(specs)}")

    def reward_spec(self):
        (spec,) = parse_reward_specs({k: {"weight": 1.0, **(v or {})} for k, v in self.reward.items()}).values()
        return spec


class RewardGradientRun(PolicyRun):
    """One reward-gradient run (a stage of :mod:`pretrain.runtime.loop`): the export, the policy, the
    differentiable reward, the prompt sampler and the runtime (resumable)."""

    def __init__(self, cfg: RewardGradientConfig):
        self.cfg = cfg
        self.ranks = ranks = StageRanks.start_batch_job(
            cfg.parallel, cfg.train.batch_size, "the global micro-batch of prompts; each rank samples its share",
            Path(cfg.run_dir) / "flight_recorder")
        self.st = st = PolicyStage.setup(cfg, "reward_gradient")
        if not METHODS.get(cfg.method.name, "method.name").needs_reference:
            st.policy.frozen_reference = None  # the method never reads the start's velocity
        self.score = differentiable_reward(cfg.reward_spec())
        ranks.shard(st.model, None, cfg.parallel, False, cfg.train.low_precision)
        self.prompts = EpochSampler(len(st.train_set), cfg.train.seed)
        self.shift = cfg.sampling.shift if cfg.sampling.shift is not None else st.meta["sampling"]["shift"]
        self.guard = Guard.for_stage(cfg.guard, st, trained=None)
        self.pretraining = DataLoss(cfg.data_loss, st, cfg.train.seed)
        resumed = self.start_runtime({"prompts": self.prompts}, headline=("reward", "heldout_reward"))
        m = cfg.method
        self.logger.write(f"reward gradient: {m.name} (k {m.k}, checkpoint {m.checkpoint}) through "
                          f"{cfg.sampling.num_inference_steps} Euler steps, CFG {cfg.sampling.guidance_scale}; reward "
                          f"{next(iter(cfg.reward))}; {ranks.layout()}"
                          + (f"; resumed from {resumed}" if resumed else ""))
        if self.rt.step == 0:
            self.logger.log(0, {"heldout_reward": self.heldout_reward(st.model)}, advance=False)
        self.start_guard()

    @property
    def step(self) -> int:
        return self.rt.step

    def sample_indices(self, n: int, micro: int) -> range:
        """The step's global indices of this rank's ``n`` samples of micro-batch ``micro`` (the keys of
        their per-sample draws, so N ranks draw what one process draws)."""
        lo = self.ranks.share(self.cfg.train.batch_size)[0] + micro * self.cfg.train.batch_size
        return range(lo, lo + n)

    def chain(self, model, idx: list[int], micro: int) -> Chain:
        """The sampling problem of prompts ``idx`` (this rank's share) of micro-batch ``micro``."""
        st, cfg = self.st, self.cfg
        _, embeds, captions = st.train_set.batch(idx)
        embeds = embeds.to(st.device)
        sigmas = st.model.sigmas(cfg.sampling.num_inference_steps, self.shift).to(st.device)
        shape = st.codec.latent_shape(st.meta["image_size"], st.meta["image_size"])
        noise = randn_per_sample(tuple(shape), cfg.train.seed, self.rt.step + 1, self.sample_indices(len(idx), micro),
                                 stream="rollout", device=st.device)
        noise = noise * st.model.initial_scale(float(sigmas[0]))

        def velocity(x, s):
            with self.rt.autocast():
                return guided_velocity(model, x, s, embeds, st.null, cfg.sampling.guidance_scale).float()

        def base_velocity(x, s):
            with st.policy.reference() as reference, self.rt.autocast():
                return guided_velocity(reference, x, s, embeds, st.null, cfg.sampling.guidance_scale).float()

        return Chain(velocity, sigmas, noise, st.codec.decode, lambda images: self.score(images, captions),
                     cfg.method.checkpoint, base_velocity)

    def train_step(self) -> dict:
        """One optimizer step: the method's loss (-reward) on ``train.grad_accum`` micro-batches."""
        cfg, st = self.cfg, self.st
        b = cfg.train.batch_size
        lo, hi = self.ranks.share(b)
        method = METHODS.get(cfg.method.name, "method.name")
        acc, metrics, model = Accumulation(self.rt), {}, st.model
        model.train()
        for micro in range(cfg.train.grad_accum):
            idx = self.prompts.next(b)[lo:hi]
            chain = self.chain(model, idx, micro)
            g = generator_for(cfg.train.seed, "window", self.rt.step, micro)  # the method's own draws
            loss, stats = method.run(chain, cfg.method, g)
            if cfg.data_loss.weight:
                data_loss = self.data_loss(model, idx, micro)
                loss, stats["data_loss"] = loss + cfg.data_loss.weight * data_loss, data_loss.item()
            acc.backward(loss, value=stats["reward"], stats={k: v for k, v in stats.items() if k != "reward"})
            metrics = acc.end_micro_batch(None, self.ranks.mean)
        metrics["reward"] = metrics.pop("loss")  # the logged value is the batch's mean reward
        return metrics

    def data_loss(self, model, idx: list[int], micro: int) -> torch.Tensor:
        """The pre-training loss (:class:`posttrain.base.data_loss.DataLoss`) on the train images of
        prompts ``idx``, keyed by their indices in the step."""
        return self.pretraining(model, idx, self.rt.step, list(self.sample_indices(len(idx), micro)), self.rt.autocast)

    @torch.no_grad()
    def heldout_reward(self, model) -> float:
        """Mean reward of ODE samples (the ``sampling`` chain, fixed seeds) of the first
        ``eval.grid_prompts`` held-out prompts."""
        st, cfg = self.st, self.cfg
        n = min(cfg.eval.grid_prompts, len(st.held))
        _, embeds, captions = st.held.batch(list(range(n)))
        shape = st.codec.latent_shape(st.meta["image_size"], st.meta["image_size"])
        noise = initial_noise(n, shape, cfg.train.seed, stream="eval", device=st.device)
        was = model.training
        model.eval()
        try:
            latents = sample_latents(model, embeds.to(st.device), st.null, noise, cfg.sampling.num_inference_steps,
                                     cfg.sampling.guidance_scale, self.shift)
            return float(self.score(st.codec.decode(latents), captions).mean())
        finally:
            model.train(was)

    def held_out(self, step: int, last: bool) -> tuple[dict, list[Path]]:
        """Every ``eval.every`` steps and at the last: ``heldout_reward`` and (but at the last) a grid."""
        e, out, media = self.cfg.eval, {}, []
        if last or (e.every and step % e.every == 0):
            with self.rt.sampling_model() as model:
                out["heldout_reward"] = self.heldout_reward(model)
                if not last:
                    media.append(self.grid(model, step))
        return out, media

    def grid(self, model: torch.nn.Module, step: int) -> Path:
        was = model.training
        model.eval()
        try:
            return self.ranks.grid(self.st, model, self.cfg.eval, self.cfg.train.seed, self.shift,
                                   f"heldout_step_{step:06d}.png")
        finally:
            model.train(was)


def train(cfg: RewardGradientConfig) -> Path:
    """Run the stage (resuming when ``checkpoint.resume`` is set); returns the export folder."""
    return run_stage(RewardGradientRun(cfg))
