"""The LTX-2 codec: the sampler's state is LTX-2's joint video + audio token sequence, and videos come out of
its video VAE (``AutoencoderKLLTX2Video``) exactly as ``LTX2Pipeline`` decodes them.

State ``[B, S_v + S_a, C]``: the pipeline's packed video latents (``_pack_latents``: ``S_v = F' h w`` tokens of
the normalised latents' ``C`` channels, patch 1) followed by its packed audio latents (``S_a`` latent audio
frames of ``audio latent channels x latent mel bins`` features, normalised by the audio VAE's statistics).
The transformer denoises both together (audio and video attend to each other), so both are one flow state
here; rewards see the video only. The two widths must agree (128 = 8 x 16 for the released folders).
"""

from __future__ import annotations

import math

import torch

from pretrain.models.wan.codec import check_num_frames


class LTX2Codec:
    """Joint states ``[B, S_v + S_a, C]`` (module notes) -> videos float32 ``[B, F, 3, H, W]`` in [0, 1]: the video
    tokens unpacked to ``[B, C, F', h, w]``, denormalised (``latents * latents_std / scaling_factor +
    latents_mean``), decoded by the VAE (at decode timestep 0 where it is timestep-conditioned, the pipeline's
    default) and mapped from [-1, 1] as its ``VideoProcessor`` does; as the pipeline, the latents are cast to
    ``latent_dtype`` (its text embeddings' dtype, the load ``dtype``) before they are de-normalised.
    ``num_frames``: F, ``8k + 1`` for the released VAE (``ValueError`` otherwise); ``audio_tokens``: S_a.
    Encoding is refused (``ValueError``): a video has no audio track to put in the state's audio part, so only
    methods that train on the rollout's own states apply (not DPO or a pre-training loss, which encode videos)."""

    def __init__(self, vae: torch.nn.Module, num_frames: int, audio_tokens: int, audio_width: int,
                 latent_dtype: torch.dtype = torch.float32):
        self.vae = vae.eval().requires_grad_(False)
        self.latent_dtype = latent_dtype
        self.channels = int(vae.config.latent_channels)
        if audio_width != self.channels:
            raise ValueError(f"LTX-2: audio latents of {audio_width} features per frame and video latents of "
                             f"{self.channels} channels cannot share one token state")
        self.downsample = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.num_frames = check_num_frames(num_frames, self.temporal)
        self.latent_frames = (self.num_frames - 1) // self.temporal + 1
        self.audio_tokens = int(audio_tokens)

    def video_tokens(self, height: int, width: int) -> int:
        return self.latent_frames * (height // self.downsample) * (width // self.downsample)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One sample's state shape ``(S_v + S_a, C)``."""
        return (self.video_tokens(height, width) + self.audio_tokens, self.channels)

    def encode(self, videos: torch.Tensor) -> torch.Tensor:
        raise ValueError("LTX-2 codec: a video has no audio track for the state's audio tokens, so videos are not "
                         "encoded; train LTX-2 with methods that train on the rollout's own states (GRPO), not DPO "
                         "or a pre-training loss")

    @torch.no_grad()
    def decode(self, state: torch.Tensor) -> torch.Tensor:
        """``state`` ``[B, S_v + S_a, C]`` (square frames) -> videos float32 ``[B, F, 3, H, W]`` in [0, 1]."""
        from diffusers import LTX2Pipeline

        b, s, c = state.shape
        side = math.isqrt((s - self.audio_tokens) // self.latent_frames)
        if s != self.latent_frames * side * side + self.audio_tokens or c != self.channels:
            raise ValueError(f"LTX2Codec: state {tuple(state.shape)} is not {self.latent_frames} x h x h video "
                             f"tokens + {self.audio_tokens} audio tokens of {self.channels} channels")
        video = state[:, :s - self.audio_tokens].to(self.vae.device, torch.float32)
        latents = LTX2Pipeline._unpack_latents(video, self.latent_frames, side, side).to(self.latent_dtype)
        latents = LTX2Pipeline._denormalize_latents(latents, self.vae.latents_mean, self.vae.latents_std,
                                                    self.vae.config.scaling_factor).to(self.vae.dtype)
        timestep = latents.new_zeros(b) if self.vae.config.timestep_conditioning else None
        frames = self.vae.decode(latents, timestep, return_dict=False)[0]
        return (frames.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()
