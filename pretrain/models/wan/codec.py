"""The Wan video codec: ``AutoencoderKLWan`` (a causal 3D VAE) with ``WanPipeline``'s latent
normalisation, latents = (posterior mean - latents_mean) / latents_std per channel; decoding inverts it
exactly as ``WanPipeline.__call__`` does (``latents / (1 / latents_std) + latents_mean``) and maps the
VAE's [-1, 1] output to [0, 1] as its ``VideoProcessor`` does (``x * 0.5 + 0.5``, clamped).
"""

from __future__ import annotations

import torch


def check_num_frames(num_frames: int, temporal: int, key: str = "model.options.num_frames") -> int:
    """``num_frames`` if it is ``temporal * k + 1`` (k >= 0; 4k + 1 for Wan's VAE), else ``ValueError``
    naming ``key`` (the pipeline would round it silently; a rollout must know its frame count)."""
    n = int(num_frames)
    if n < 1 or (n - 1) % temporal:
        raise ValueError(f"{key}: {num_frames} frames is not {temporal}k + 1 (the VAE compresses time by "
                         f"{temporal} after the first frame), e.g. {temporal * max(1, (n - 1) // temporal) + 1}")
    return n


class WanVideoCodec:
    """Videos float ``[B, F, 3, H, W]`` in [0, 1] <-> normalised latents ``[B, C, F', h, w]`` with
    C = ``z_dim``, F' = (F - 1) // ``scale_factor_temporal`` + 1, h = H // ``scale_factor_spatial``.

    ``num_frames``: the frame count F of every video this codec samples (:meth:`latent_shape`);
    ``ValueError`` if it is not ``scale_factor_temporal * k + 1``. Encoding uses the posterior mean
    (deterministic). The VAE runs in its own dtype; outputs are float32."""

    def __init__(self, vae: torch.nn.Module, num_frames: int):
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.channels = int(cfg.z_dim)
        self.downsample = int(cfg.scale_factor_spatial)
        self.temporal = int(cfg.scale_factor_temporal)
        self.num_frames = check_num_frames(num_frames, self.temporal)
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, self.channels, 1, 1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, self.channels, 1, 1, 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One video's latent shape ``(C, F', H // s, W // s)``."""
        frames = (self.num_frames - 1) // self.temporal + 1
        return (self.channels, frames, height // self.downsample, width // self.downsample)

    @torch.no_grad()
    def encode(self, videos: torch.Tensor) -> torch.Tensor:
        """``videos [B, F, 3, H, W]`` in [0, 1] -> float32 latents ``[B, C, F', h, w]``."""
        x = (videos.permute(0, 2, 1, 3, 4) * 2 - 1).to(self.vae.device, self.vae.dtype)  # a frame may sit on the CPU
        mean = self.vae.encode(x).latent_dist.mean.float()
        return (mean - self.latents_mean.to(mean.device)) / self.latents_std.to(mean.device)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F', h, w]`` -> videos float32 ``[B, F, 3, H, W]`` in [0, 1]."""
        z = latents.to(self.vae.device, self.vae.dtype)
        mean = self.latents_mean.to(z.device, z.dtype)
        inv_std = 1.0 / self.latents_std.to(z.device, z.dtype)
        video = self.vae.decode(z / inv_std + mean, return_dict=False)[0]
        return (video.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()


class WanImageToVideoCodec(WanVideoCodec):
    """:class:`WanVideoCodec` of a ``WanImageToVideoPipeline`` folder, which also encodes the first frames
    its prompts carry (:func:`pretrain.codec.encode_conditions`) as the pipeline's ``prepare_latents``
    builds its condition (Wan2.2 I2V-A14B; Wan team 2025, arXiv 2503.20314, Sec. 5.1).

    :meth:`encode_conditions`: images float ``[B, 3, H, W]`` in [0, 1] -> float32
    ``[B, T + C, F', h, w]``, T = ``scale_factor_temporal``: the frame mask (1 on the latent frame of the
    given image, 0 after it, T channels per latent frame) followed by the normalised posterior mean of
    the video [image, F - 1 frames of 0 in [-1, 1]]. The denoiser takes it concatenated to its latents
    along channels. :meth:`decode_conditions` returns the image from the condition's first latent frame
    (the causal VAE encodes the first frame alone)."""

    @torch.no_grad()
    def encode_conditions(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"WanImageToVideoCodec: conditioning images {tuple(images.shape)}; expected "
                             f"[B, 3, H, W] first frames in [0, 1]")
        b, _, h, w = images.shape
        rest = images.new_full((b, self.num_frames - 1, 3, h, w), 0.5)  # 0 once mapped to [-1, 1]
        latents = self.encode(torch.cat([images[:, None], rest], 1))
        mask = torch.zeros(b, self.temporal, *latents.shape[2:], device=latents.device)  # on the VAE's device
        mask[:, :, 0] = 1.0
        return torch.cat([mask, latents], 1)

    @torch.no_grad()
    def decode_conditions(self, conditions: torch.Tensor) -> torch.Tensor:
        return self.decode(conditions[:, self.temporal:, :1])[:, 0]
