"""Codecs map images in [0, 1] to the model's sample space and back.

``PatchifyCodec`` is the pixel-space codec of the tiny/small presets; ``VAECodec`` wraps a diffusers
``AutoencoderKL`` (SD3/FLUX latents with scaling and shift factors) for latent models.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

import torch
import torch.nn.functional as F


class Codec(Protocol):
    """``encode(images [B, 3, H, W] float in [0, 1]) -> latents [B, C, h, w]``;
    ``decode(latents) -> images [B, 3, H, W] float32 in [0, 1]``; ``latent_shape(H, W)``: one
    sample's latent shape (video codecs: ``[C, F', h, w]`` and images ``[B, F, 3, H, W]``)."""

    channels: int
    downsample: int

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]: ...

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


def encode_conditions(codec, images: torch.Tensor) -> torch.Tensor:
    """Prompts' conditioning images (an edit's source, an image-to-video clip's first frame), float
    ``[B, 3, H, W]`` in [0, 1], as the denoiser takes them (``PromptEmbeds.images``): the codec's own
    ``encode_conditions`` where it has one (Wan image-to-video: the first frame's video latents with
    their frame mask, :class:`pretrain.models.wan.codec.WanImageToVideoCodec`), else its ``encode``."""
    own = getattr(codec, "encode_conditions", None)
    return own(images) if own is not None else codec.encode(images)


def decode_conditions(codec, conditions: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`encode_conditions`: the conditioning images float32 ``[B, 3, H, W]`` in
    [0, 1] (what rewards read as ``metadata["source_images"]``)."""
    own = getattr(codec, "decode_conditions", None)
    return own(conditions) if own is not None else codec.decode(conditions)


class PatchifyCodec:
    """Pixel space: images to [-1, 1], then space-to-depth by ``factor`` (1 = identity layout).

    ``channels = 3 * factor**2``, ``downsample = factor``. Decoding clamps to [0, 1]."""

    def __init__(self, factor: int = 1):
        if factor < 1:
            raise ValueError(f"PatchifyCodec factor must be >= 1, got {factor}")
        self.factor = factor
        self.channels = 3 * factor * factor
        self.downsample = factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.channels, height // self.downsample, width // self.downsample)

    @property
    def identity(self) -> str:
        """What a latent cache records to refuse latents of another codec."""
        return f"patchify-f{self.factor}"

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        x = images * 2 - 1
        return F.pixel_unshuffle(x, self.factor) if self.factor > 1 else x

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = F.pixel_shuffle(latents, self.factor) if self.factor > 1 else latents
        return ((x.float() + 1) / 2).clamp(0, 1)


class VideoPatchifyCodec:
    """Pixel-space video: videos ``[B, F, 3, H, W]`` in [0, 1] to [-1, 1], then space-to-depth by
    ``factor`` per frame, laid out as video latents ``[B, C, F, H / factor, W / factor]`` with
    C = ``3 * factor**2`` (+ 1 with ``frame_code``); ``decode`` maps such latents back to videos
    ``[B, F, 3, H, W]`` float32 in [0, 1]
    (the ``[B, C, F, h, w]`` layout of diffusers video transformers). ``frames``: F, for
    ``latent_shape``. Decoding clamps to [0, 1].

    ``frame_code``: append one latent channel holding each frame's index, linearly from -1 (first
    frame) to 1 (last), constant over the frame; decoding drops it. Wan's 3-D RoPE gives only relative
    temporal positions, and over a codec that treats every frame alike the small presets trained
    nearly time-reversal equivariant (1-2 %), unable to tell "moving left" from its reverse; the code
    is an absolute temporal cue, as a causal video VAE's separately encoded first frame is. It is
    noised and denoised with the pixels: a cue the model learns to use, not a guarantee."""

    def __init__(self, factor: int = 1, frames: int = 8, frame_code: bool = False):
        if factor < 1 or frames < 1:
            raise ValueError(f"VideoPatchifyCodec: factor and frames must be >= 1, got {factor}, {frames}")
        self.frames, self.image, self.frame_code = frames, PatchifyCodec(factor), bool(frame_code)
        self.channels, self.downsample = self.image.channels + int(self.frame_code), factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.channels, self.frames, height // self.downsample, width // self.downsample)

    @property
    def identity(self) -> str:
        return f"video_patchify-f{self.image.factor}-F{self.frames}" + ("-code" if self.frame_code else "")

    def encode(self, videos: torch.Tensor) -> torch.Tensor:
        b, f = videos.shape[:2]
        x = self.image.encode(videos.flatten(0, 1))
        x = x.view(b, f, *x.shape[1:]).transpose(1, 2)
        if not self.frame_code:
            return x
        code = torch.linspace(-1, 1, f, dtype=x.dtype, device=x.device) if f > 1 else x.new_zeros(1)
        return torch.cat([x, code.view(1, 1, f, 1, 1).expand(b, 1, f, *x.shape[3:])], dim=1)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.frame_code:
            latents = latents[:, :-1]
        b, _, f = latents.shape[:3]
        x = self.image.decode(latents.transpose(1, 2).flatten(0, 1))
        return x.view(b, f, *x.shape[1:])


class VAECodec:
    """A diffusers ``AutoencoderKL`` (or any VAE with ``encode().latent_dist`` / ``decode().sample``):
    latents = (mean - shift_factor) * scaling_factor, as SD3/FLUX pipelines do. Encoding uses the
    posterior mean (deterministic). Inputs move to the VAE's device (a prompt's conditioning image is
    kept on the CPU with its dataset); outputs stay there."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.scaling_factor = float(getattr(cfg, "scaling_factor", 1.0) or 1.0)
        self.shift_factor = float(getattr(cfg, "shift_factor", 0.0) or 0.0)
        self.channels = int(cfg.latent_channels)
        self.downsample = 2 ** (len(cfg.block_out_channels) - 1)

    @classmethod
    def from_pretrained(cls, path: str, subfolder: str = "vae", device: str = "cpu") -> "VAECodec":
        from diffusers import AutoencoderKL

        return cls(AutoencoderKL.from_pretrained(path, subfolder=subfolder).to(device))

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.channels, height // self.downsample, width // self.downsample)

    @property
    def identity(self) -> str:
        """``vae-<digest>`` of the VAE's config (without diffusers' ``_name_or_path`` and version) and
        weights (SHA-256 of every parameter's bytes): what a latent cache records to refuse latents of
        another VAE, wherever the same one is loaded from."""
        config = {k: v for k, v in dict(self.vae.config).items() if not k.startswith("_")}  # not its path
        h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        for name, t in sorted(self.vae.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return f"vae-{h.hexdigest()[:16]}"

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        dist = self.vae.encode((images * 2 - 1).to(self.vae.device, self.vae.dtype)).latent_dist
        return (dist.mean - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = (latents / self.scaling_factor + self.shift_factor).to(self.vae.device, self.vae.dtype)
        x = self.vae.decode(z).sample
        return ((x.float() + 1) / 2).clamp(0, 1)


from dataclasses import dataclass  # noqa: E402


@dataclass
class CodecConfig:
    """``name``: "patchify" (pixel space, ``factor`` space-to-depth), "video_patchify" (the same per
    frame of ``frames``-frame videos; ``frame_code`` adds the frame-index channel of
    :class:`VideoPatchifyCodec`) or "vae" (a diffusers ``AutoencoderKL`` from the local folder
    ``path``/``subfolder``)."""

    name: str = "patchify"
    factor: int = 1
    frames: int = 8
    frame_code: bool = False
    path: str | None = None
    subfolder: str = "vae"


def build_codec(cfg: CodecConfig, device: str = "cpu") -> Codec:
    """Build a codec (a VAE's weights on ``device``); ``ValueError`` for an unknown name or a VAE
    without a path."""
    if cfg.name == "patchify":
        return PatchifyCodec(cfg.factor)
    if cfg.name == "video_patchify":
        return VideoPatchifyCodec(cfg.factor, cfg.frames, cfg.frame_code)
    if cfg.name == "vae":
        if not cfg.path:
            raise ValueError("codec.path: required for the 'vae' codec (a local diffusers folder)")
        return VAECodec.from_pretrained(cfg.path, cfg.subfolder, device)
    raise ValueError(f"codec.name: unknown codec '{cfg.name}' (known: patchify, video_patchify, vae)")
