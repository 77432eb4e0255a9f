"""LTX-2 pipeline folders (diffusers ``LTX2Pipeline``; Lightricks 2026, arXiv 2601.03233): an audio-video
diffusion transformer (``LTX2VideoTransformer3DModel``) that denoises video latents and audio latents
together, each stream attending to the other, conditioned on a Gemma-3 text encoder's every layer through
the pipeline's text connectors.

As the pipeline does:

- the state is the joint token sequence of :mod:`pretrain.models.ltx2.codec` (packed video latents, then
  packed audio latents); the transformer predicts both velocities, the adapter returns them in the same
  layout, so the ODE and SDE move video and audio together; rewards score the decoded video;
- the schedule is ``linspace(1, 1 / n, n)`` set on the folder's scheduler with ``mu`` from the video token
  count (``calculate_shift`` with the scheduler's base / max lengths and shifts);
- the timestep is sigma x ``num_train_timesteps``, given as both ``timestep`` and ``sigma`` (LTX-2.3's
  prompt modulation), ``use_cross_timestep`` on, RoPE coordinates at the conditioning frame rate;
- prompts through ``encode_prompt`` then the ``connectors``: the video and audio text states side by side in
  one token tensor; the text mask the pipeline passes is the connectors' (which zero the video states where
  it is 0), so it is read back from the video states (all ones for the released folders: their connectors
  fill the padding with learned registers);
- CFG per stream: ``guidance_scale`` on the video tokens and ``audio_guidance_scale`` on the audio tokens
  (the pipeline's delta in x0 space is the same delta in velocity), both branches run when either exceeds 1;
- the final latents are cast to the transformer's dtype before they are de-normalised and decoded.

Our sampler applies CFG only: it equals ``LTX2Pipeline`` called with ``stg_scale=0`` and ``audio_stg_scale=0``
(no spatio-temporal guidance pass), ``modality_scale=1`` and ``audio_modality_scale=1`` (no modality-isolation
pass) and ``guidance_rescale=0`` and ``audio_guidance_rescale=0`` (the pipeline's defaults add those two extra
transformer passes per step and a rescale of each stream's guided prediction). Square frames only
(``image_size``; the pipeline's default is 512 x 768). No presets; no tensor, sequence or context parallel
plan; the audio is denoised but not decoded.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pretrain.backbone import Backbone
from pretrain.models.common import (PipelinePromptEncoder, call_defaults, check_image_size, checked_options,
                                      family_meta, text_mask)
from pretrain.models.flow_schedule import dynamic_shift_sigmas
from pretrain.models.ltx2.codec import LTX2Codec
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
PIPELINE = "LTX2Pipeline"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "num_frames", "frame_rate", "guidance_scale", "audio_guidance_scale", "num_inference_steps",
           "max_sequence_length", "dtype")
#: Every attention's projections: video self / text, audio self / text, and the two cross-modal ones.
LTX2_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
NUM_FRAMES = 121  # LTX2Pipeline's fixed frame count for folders without a duration head


def ltx2_mu(config: dict, video_tokens: int, num_inference_steps: int) -> float:
    """``LTX2Pipeline``'s dynamic shift: ``calculate_shift`` of the video token count between the scheduler
    config's base and max lengths (its defaults 1024 / 4096, 0.95 / 2.05; ``num_inference_steps`` unused)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    return calculate_shift(video_tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.95), config.get("max_shift", 2.05))


def ltx2_sigmas(scheduler_class, config: dict, video_tokens: int, num_inference_steps: int,
                shift: float | None = None) -> torch.Tensor:
    """The sigmas ``LTX2Pipeline`` walks, float32 ``[n + 1]`` ending in 0: the FLUX-style schedule
    (:func:`pretrain.models.flow_schedule.dynamic_shift_sigmas`, ``linspace(1, 1 / n, n)``) with ``mu`` from
    ``video_tokens`` (:func:`ltx2_mu`); a not-None ``shift`` replaces the dynamic shift. ``ValueError`` for
    another scheduler or ``n < 1``."""
    if scheduler_class.__name__ != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"LTX-2 scheduler '{scheduler_class.__name__}' is not supported "
                         f"(FlowMatchEulerDiscreteScheduler)")
    return dynamic_shift_sigmas(scheduler_class, config, video_tokens, num_inference_steps, shift, mu_of=ltx2_mu)


class LTX2Adapter(Backbone):
    """Wraps ``LTX2VideoTransformer3DModel``: ``forward(x [B, S_v + S_a, C], sigma [B] in [0, 1], embeds) ->
    velocity`` float32 of ``x``'s shape (the codec's joint state; the video geometry ``latent_frames`` x
    ``side`` x ``side`` and ``audio_tokens`` fixed at load). ``embeds.tokens`` ``[B, L, D_v + D_a]``: the
    connectors' video then audio text states (``video_text_dim`` = D_v); ``embeds.pooled`` ``[B, 0]``.
    Blocks (FSDP2 units): ``transformer_blocks``; no tensor, sequence or context parallel plan."""

    lora_targets = LTX2_ATTENTION
    block_attrs = ("transformer_blocks",)
    tp_plan = None

    def __init__(self, transformer: torch.nn.Module, scheduler, latent_frames: int, side: int, audio_tokens: int,
                 frame_rate: float, video_text_dim: int, audio_guidance_scale: float | None):
        super().__init__(transformer)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.latent_frames, self.side, self.audio_tokens = int(latent_frames), int(side), int(audio_tokens)
        self.frame_rate, self.video_text_dim = float(frame_rate), int(video_text_dim)
        self.audio_guidance_scale = None if audio_guidance_scale is None else float(audio_guidance_scale)

    @property
    def guides_at_unit_scale(self) -> bool:
        """True when the audio has a guidance scale of its own other than 1: ``LTX2Pipeline`` then runs CFG
        (on the audio) even at a video ``guidance_scale`` of 1, and so does our sampler
        (:func:`pretrain.guidance.uses_cfg`)."""
        return self.audio_guidance_scale not in (None, 1.0)

    @property
    def video_tokens(self) -> int:
        return self.latent_frames * self.side * self.side

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        return ltx2_sigmas(self.scheduler_class, self.scheduler_config, self.video_tokens, num_inference_steps, shift)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma.float() * float(self.scheduler_config["num_train_timesteps"])

    def cfg_combine(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """``guidance_scale`` on the video tokens, ``audio_guidance_scale`` on the audio tokens (None: the video's,
        the pipeline's fallback)."""
        scale = torch.full((v_cond.shape[1], 1), float(guidance_scale), device=v_cond.device)
        if self.audio_guidance_scale is not None:
            scale[self.video_tokens:] = self.audio_guidance_scale
        return v_cond + (scale - 1) * (v_cond - v_uncond)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        b, s, _ = x.shape
        if s != self.video_tokens + self.audio_tokens:
            raise ValueError(f"LTX2Adapter: {s} state tokens, loaded for {self.video_tokens} video tokens "
                             f"({self.latent_frames} x {self.side} x {self.side}) + {self.audio_tokens} audio tokens")
        dtype, device = self.transformer.dtype, x.device
        tokens = embeds.tokens.to(device)
        video_text, audio_text = tokens[..., :self.video_text_dim], tokens[..., self.video_text_dim:]
        mask = text_mask(video_text).long()  # the connectors' mask: they zero the video states where it is 0
        t = self.timestep(sigma.to(device))
        video, audio = self.transformer(
            hidden_states=x[:, :self.video_tokens].to(dtype), audio_hidden_states=x[:, self.video_tokens:].to(dtype),
            encoder_hidden_states=video_text.to(dtype), audio_encoder_hidden_states=audio_text.to(dtype),
            timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=self.latent_frames, height=self.side, width=self.side,
            fps=conditioning_frame_rate(self.frame_rate, 1.0), audio_num_frames=self.audio_tokens,
            use_cross_timestep=True, return_dict=False)
        return torch.cat([video.float(), audio.float()], 1)


class LTX2PromptEncoder(PipelinePromptEncoder):
    """``LTX2Pipeline.encode_prompt`` then its ``connectors`` (no CFG): ``encode(prompts) -> PromptEmbeds(tokens
    [B, L, D_v + D_a], pooled [B, 0])`` float32 on the CPU, the video text states then the audio ones.
    ``encode([""])`` is the pipeline's unconditional embedding."""

    name = "ltx2"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "ltx2", path, max_sequence_length, dtype, device)
        cfg = pipe.connectors.config
        self.video_dim = int(cfg.video_connector_num_attention_heads * cfg.video_connector_attention_head_dim)
        audio_dim = cfg.audio_connector_num_attention_heads * cfg.audio_connector_attention_head_dim
        self.dim = self.video_dim + int(audio_dim)
        self.pooled_dim = 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask, _, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                     max_sequence_length=self.max_sequence_length, device=self.device)
        video, audio, _ = self.pipe.connectors(embeds, mask, padding_side=self.pipe.tokenizer.padding_side)
        tokens = torch.cat([video, audio], -1)
        return tokens, tokens.new_zeros(tokens.shape[0], 0)


def audio_geometry(pipe, num_frames: int, frame_rate: float) -> tuple[int, int]:
    """(latent audio frames of a ``num_frames`` video at ``frame_rate``, features per packed audio token), as
    ``LTX2Pipeline.__call__`` sizes its audio latents."""
    per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
    cfg = pipe.audio_vae.config
    width = cfg.latent_channels * (cfg.mel_bins // pipe.audio_vae_mel_compression_ratio)
    return round(num_frames / frame_rate * per_second), int(width)


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load an ``LTX2Pipeline`` folder: ``(LTX2Adapter, LTX2PromptEncoder, LTX2Codec, meta)``.

    ``options``: ``image_size`` (square pixels; default the pipeline's height, 512; a multiple of 32, as the
    pipeline requires), ``num_frames`` (8k + 1; default 121), ``frame_rate`` (24),
    ``guidance_scale`` (3.0), ``audio_guidance_scale`` (7.0; None: the video's), ``num_inference_steps`` (30),
    ``max_sequence_length`` (1024), ``dtype`` ("float32", "bfloat16", "float16": the transformer, text encoder
    and connectors; the VAEs stay float32). Raises ``ValueError`` naming the key for an unknown option, a bad
    size, frame count or dtype, an unsupported scheduler or patching, or audio and video widths that differ."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline

    path = Path(path)
    options, dtype = checked_options(options, OPTIONS, DTYPES, "LTX-2")
    defaults = call_defaults(LTX2Pipeline, "height", "frame_rate", "num_inference_steps", "guidance_scale",
                             "audio_guidance_scale", "max_sequence_length")
    vae = AutoencoderKLLTX2Video.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    audio_vae = AutoencoderKLLTX2Audio.from_pretrained(path, subfolder="audio_vae", dtype=torch.float32)
    pipe = LTX2Pipeline.from_pretrained(str(path), vae=vae, audio_vae=audio_vae, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer.eval()
    if transformer.config.patch_size != 1 or transformer.config.patch_size_t != 1:
        raise ValueError(f"{path}: LTX-2 transformer patch sizes {transformer.config.patch_size} / "
                         f"{transformer.config.patch_size_t}; only 1 / 1 (the released folders) is supported")
    # the pipeline's own check: 32 px (the released VAE's compression) whatever the VAE
    size = check_image_size(int(options.get("image_size") or defaults["height"]),
                            math.lcm(32, pipe.vae_spatial_compression_ratio))
    frame_rate = float(options.get("frame_rate", defaults["frame_rate"]))
    num_frames = int(options.get("num_frames", NUM_FRAMES))
    audio_tokens, audio_width = audio_geometry(pipe, num_frames, frame_rate)
    codec = LTX2Codec(pipe.vae, num_frames, audio_tokens, audio_width, DTYPES[dtype])
    side = size // codec.downsample
    ltx2_sigmas(type(pipe.scheduler), dict(pipe.scheduler.config), codec.video_tokens(size, size), 2)  # refuses early
    text_pipe = LTX2Pipeline(scheduler=pipe.scheduler, vae=None, audio_vae=None, transformer=None, vocoder=None,
                             text_encoder=pipe.text_encoder.eval().requires_grad_(False), tokenizer=pipe.tokenizer,
                             connectors=pipe.connectors.eval().requires_grad_(False))
    length = int(options.get("max_sequence_length", defaults["max_sequence_length"]))
    encoder = LTX2PromptEncoder(text_pipe, path, length, dtype, device)
    audio_scale = options.get("audio_guidance_scale", defaults["audio_guidance_scale"])
    model = LTX2Adapter(transformer, pipe.scheduler, codec.latent_frames, side, audio_tokens, frame_rate,
                        encoder.video_dim, audio_scale)
    meta = family_meta("ltx2", PIPELINE, COMPONENT, path, size, options, defaults)
    return model, encoder, codec, meta
