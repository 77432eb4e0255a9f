"""Reward-gradient fine-tuning: the reward's gradient back-propagated through (part of) the sampling chain.

Convention (:mod:`pretrain.flow`): x_sigma = (1 - sigma) x0 + sigma eps, the model predicts v = eps - x0,
an Euler step from sigma to sigma' is x + (sigma' - sigma) v, and x0 = x_sigma - sigma v in one step.
Every method maximises r(decode(x0)) of a differentiable reward r (loss = -r, mean over the batch); they
differ in which steps carry the gradient:

- **DRaFT-K** (Clark et al. 2024, arXiv 2309.17400, sec. 4.1, eq. 3): the whole chain is sampled, the
  gradient flows through the last K steps only (the first N - K under ``no_grad``). K = 1 is DRaFT-1.
- **DRaFT-LV** (same paper, sec. 4.2): K = 1, and the last step's input is re-noised from the sample n
  times, x' = (1 - sigma_1) sg(x0) + sigma_1 eps_i, each denoised in one step; the rewards of the n
  predictions are averaged (a lower-variance estimate of the last step's gradient).
- **ReFL** (Xu et al. 2023, ImageReward, arXiv 2304.05977, Algorithm 1): sample without gradient down to
  a step t drawn uniformly from the last ``refl_last`` steps, predict x0 in one step from there with the
  gradient, and score that prediction.
- **AlignProp** (Prabhudesai et al. 2023, arXiv 2310.03739, sec. 4): randomised truncation, K drawn
  uniformly from 1..``K`` each iteration, with gradient checkpointing of every step that carries the
  gradient (memory of one step's activations instead of K).

Memory: with ``checkpoint`` each step that carries the gradient is wrapped in
``torch.utils.checkpoint.checkpoint`` (its activations are recomputed in the backward pass), and the
decoder's activations likewise, so activation memory is that of one step plus K stored states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pretrain.flow import euler_step

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Chain:
    """One batch's sampling problem. ``velocity(x, sigma [B]) -> v`` (the guided policy velocity,
    float32 like ``x``); ``sigmas``: float ``[N + 1]`` from the first sigma down to 0; ``noise``: the
    initial state ``[B, ...]`` (already scaled to the first sigma); ``decode(latents) -> images`` float
    ``[B, 3, H, W]`` in [0, 1] (differentiable); ``reward(images) -> [B]`` float32, differentiable in the
    images; ``checkpoint``: recompute step and decoder activations in backward; ``base_velocity``: the
    reference model's velocity like ``velocity`` (Adjoint Matching; None for the others)."""

    velocity: VelocityFn
    sigmas: torch.Tensor
    noise: torch.Tensor
    decode: Callable[[torch.Tensor], torch.Tensor]
    reward: Callable[[torch.Tensor], torch.Tensor]
    checkpoint: bool = False
    base_velocity: VelocityFn | None = None

    def step(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Euler step i (sigma_i -> sigma_{i+1}), checkpointed when asked and gradients are on."""
        def run(x):
            s = self.sigmas[i].expand(x.shape[0])
            return euler_step(x, self.velocity(x, s), self.sigmas[i], self.sigmas[i + 1])

        if self.checkpoint and torch.is_grad_enabled():
            return torch_checkpoint(run, x, use_reentrant=False)
        return run(x)

    def predict_x0(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """x0 = x - sigma_i v(x, sigma_i): the one-step prediction of the clean sample from step i."""
        def run(x):
            s = self.sigmas[i].expand(x.shape[0])
            return x - self.sigmas[i] * self.velocity(x, s)

        if self.checkpoint and torch.is_grad_enabled():
            return torch_checkpoint(run, x, use_reentrant=False)
        return run(x)

    def score(self, x0: torch.Tensor) -> torch.Tensor:
        """The reward of the decoded latents ``x0``, float32 ``[B]`` (decoder checkpointed when asked)."""
        images = torch_checkpoint(self.decode, x0, use_reentrant=False) \
            if self.checkpoint and torch.is_grad_enabled() else self.decode(x0)
        return self.reward(images).float()

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    def run(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        """Steps ``start`` .. ``stop - 1`` from ``x`` (with the current grad mode)."""
        for i in range(start, stop):
            x = self.step(x, i)
        return x


def draft_k(chain: Chain, k: int) -> tuple[torch.Tensor, dict]:
    """DRaFT-K: (loss = -mean reward, metrics). The first N - K steps without gradient, the last K with
    it; ``k`` is clipped to [1, N]. Metrics: ``reward`` (mean), ``grad_steps`` (K used)."""
    n = chain.num_steps
    k = max(1, min(k, n))
    with torch.no_grad():
        x = chain.run(0, n - k, chain.noise)
    x0 = chain.run(n - k, n, x.detach())
    reward = chain.score(x0)
    return -reward.mean(), {"reward": reward.mean().item(), "grad_steps": float(k)}


def draft_lv(chain: Chain, n_noise: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """DRaFT-LV: the chain without gradient to x0, then ``n_noise`` re-noisings to the last nonzero sigma
    sigma_1, x' = (1 - sigma_1) x0 + sigma_1 eps_i, each denoised in one step with the gradient; loss =
    -mean over i and the batch of r(x0_i). ``generator`` draws eps_i."""
    n = chain.num_steps
    with torch.no_grad():
        x0 = chain.run(0, n, chain.noise)
    last = n - 1
    sigma = chain.sigmas[last]
    rewards = []
    for _ in range(max(1, n_noise)):
        eps = torch.randn(x0.shape, generator=generator, device="cpu").to(x0.device, x0.dtype)
        x = (1 - sigma) * x0 + sigma * eps
        rewards.append(chain.score(chain.predict_x0(x, last)))
    reward = torch.stack(rewards).mean(0)
    return -reward.mean(), {"reward": reward.mean().item(), "grad_steps": 1.0}


def refl(chain: Chain, last: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """ReFL: sample without gradient to step t, drawn uniformly from the last ``last`` steps (t in
    [N - last, N - 1]), then x0 = x_t - sigma_t v(x_t, sigma_t) with the gradient; loss = -mean r(x0).
    Metrics add ``refl_step`` (t)."""
    n = chain.num_steps
    last = max(1, min(last, n))
    t = n - last + int(torch.randint(last, (1,), generator=generator))
    with torch.no_grad():
        x = chain.run(0, t, chain.noise)
    reward = chain.score(chain.predict_x0(x.detach(), t))
    return -reward.mean(), {"reward": reward.mean().item(), "grad_steps": 1.0, "refl_step": float(t)}


def alignprop(chain: Chain, k_max: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """AlignProp: DRaFT-K with K drawn uniformly from 1..``k_max`` this iteration (randomised truncated
    backpropagation); the caller sets ``chain.checkpoint`` (AlignProp's gradient checkpointing)."""
    k = 1 + int(torch.randint(max(1, min(k_max, chain.num_steps)), (1,), generator=generator))
    return draft_k(chain, k)
