"""Per-sample denoising errors for Diffusion-DPO, one function per prediction type.

Winner and loser rows must share noise, timestep and prompt embedding: callers pass them stacked as
``[winners; losers]`` with the noise/timestep of pair i repeated at rows i and P + i.
"""

from __future__ import annotations

import torch

from pretrain.flow import interpolate, velocity_target
from pretrain.text_encoder import PromptEmbeds


def flow_residuals(model, x0: torch.Tensor, embeds: PromptEmbeds, noise: torch.Tensor, sigma: torch.Tensor
                   ) -> torch.Tensor:
    """The velocity residual v - (eps - x0) of a flow-matching ``model(x_sigma, sigma, embeds) -> v`` at
    x_sigma = (1 - sigma) x0 + sigma eps, float32 ``[N, ...]``; its per-sample mean square is the velocity
    error Diffusion-DPO compares (``flow_matching_loss``'s value)."""
    v = model(interpolate(x0, noise, sigma), sigma, embeds)
    return v.float() - velocity_target(x0.float(), noise.float())


def eps_errors(unet, scheduler, x0: torch.Tensor, encoder_hidden_states: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
    """Noise error of an epsilon-prediction ``UNet2DConditionModel`` with a diffusers DDPM/DDIM
    ``scheduler``: float32 ``[N]``, mean over elements of (eps_theta(x_t, t) - eps)^2 where
    x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps (``scheduler.add_noise``)."""
    x_t = scheduler.add_noise(x0, noise, timesteps)
    pred = unet(x_t, timesteps, encoder_hidden_states=encoder_hidden_states).sample
    return (pred.float() - noise.float()).square().flatten(1).mean(1)
