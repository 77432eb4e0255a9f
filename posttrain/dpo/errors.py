"""Per-sample denoising errors for Diffusion-DPO, one function per prediction type.

Winner and loser rows must share noise, timestep and prompt embedding: callers pass them stacked as
``[winners; losers]`` with the noise/timestep of pair i repeated at rows i and P + i.
"""

from __future__ import annotations

import torch

from pretrain.flow import flow_matching_loss, interpolate
from pretrain.text_encoder import PromptEmbeds


def flow_errors(model, x0: torch.Tensor, embeds: PromptEmbeds, noise: torch.Tensor, sigma: torch.Tensor
                ) -> torch.Tensor:
    """Velocity error of a flow-matching ``model(x_sigma, sigma, embeds) -> v``: float32 ``[N]``,
    mean over elements of (v - (eps - x0))^2 at x_sigma = (1 - sigma) x0 + sigma eps."""
    return flow_matching_loss(model(interpolate(x0, noise, sigma), sigma, embeds), x0, noise)


def eps_errors(unet, scheduler, x0: torch.Tensor, encoder_hidden_states: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
    """Noise error of an epsilon-prediction ``UNet2DConditionModel`` with a diffusers DDPM/DDIM
    ``scheduler``: float32 ``[N]``, mean over elements of (eps_theta(x_t, t) - eps)^2 where
    x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps (``scheduler.add_noise``)."""
    x_t = scheduler.add_noise(x0, noise, timesteps)
    pred = unet(x_t, timesteps, encoder_hidden_states=encoder_hidden_states).sample
    return (pred.float() - noise.float()).square().flatten(1).mean(1)
