"""FLUX.2 [klein] pipeline folders (diffusers ``Flux2KleinPipeline``; Black Forest Labs 2025):
``Flux2TransformerModel`` (double- and single-stream blocks, 4-axis RoPE over (t, h, w, l) ids), Qwen3
hidden states of three layers as text conditioning, ``AutoencoderKLFlux2`` whose latents are 2 x 2
patchified and batch-normalised, and a ``FlowMatchEulerDiscreteScheduler`` shifted by the pipeline's
empirical mu (a function of the image sequence length and the step count).

As the pipeline does: the sampler's state is the patchified, normalised latents ``[B, 4C, h/2, w/2]``
(the codec's latent shape); the adapter flattens them to the token sequence ``[B, (h/2)(w/2), 4C]`` with
the pipeline's position ids for every forward; the timestep is the scheduler's cast to the weights'
dtype over 1000; prompts go through ``encode_prompt`` (the chat template, padded to
``max_sequence_length``, layers 9, 18 and 27 concatenated); guidance is plain two-branch CFG with the
empty negative prompt (none for a step-distilled folder, ``is_distilled``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.backbone import Backbone
from pretrain.models.common import (JOINT_ATTENTION, PipelinePromptEncoder, SchedulerTimestep, call_defaults,
                                      check_image_size, checked_options, family_meta, prompt_encoder_of)
from pretrain.models.flow_schedule import dynamic_shift_sigmas
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
PIPELINE = "Flux2KleinPipeline"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype")


def empirical_mu(config: dict, image_seq_len: int, num_inference_steps: int) -> float:
    """``Flux2KleinPipeline``'s shift: ``compute_empirical_mu(image_seq_len, num_inference_steps)``."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    return compute_empirical_mu(image_seq_len, num_inference_steps)


class Flux2Adapter(SchedulerTimestep, Backbone):
    """Wraps ``Flux2Transformer2DModel``: ``forward(x [B, 4C, h', w'], sigma [B] in [0, 1], embeds) -> v``
    float32 like ``x``; ``embeds.tokens`` ``[B, L, 3 D]`` (Qwen3 layers concatenated), ``embeds.pooled``
    ``[B, 0]`` unused. ``image_seq_len`` (tokens of one image) sets the schedule's mu. Blocks: the
    double-stream ``transformer_blocks``, then the ``single_transformer_blocks``; LoRA on their attention
    projections (the single blocks' fused ``to_qkv_mlp_proj``)."""

    lora_targets = [*JOINT_ATTENTION, "attn.to_qkv_mlp_proj"]
    block_attrs = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, transformer: torch.nn.Module, scheduler, image_seq_len: int):
        super().__init__(transformer)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.image_seq_len = int(image_seq_len)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's schedule (:func:`pretrain.models.flow_schedule.dynamic_shift_sigmas` with the
        empirical mu)."""
        return dynamic_shift_sigmas(self.scheduler_class, self.scheduler_config, self.image_seq_len,
                                    num_inference_steps, shift, empirical_mu)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline as P

        b, c, h, w = x.shape
        dtype, device = next(self.transformer.parameters()).dtype, x.device
        tokens = embeds.tokens.to(device, dtype)
        out = self.transformer(hidden_states=P._pack_latents(x.to(dtype)), encoder_hidden_states=tokens,
                               timestep=self.fed_timestep(sigma.to(device), dtype), guidance=None,
                               img_ids=P._prepare_latent_ids(x).to(device),
                               txt_ids=P._prepare_text_ids(tokens).to(device), return_dict=False)[0]
        return out.float().permute(0, 2, 1).reshape(b, c, h, w)  # the ids are raster order: a reshape


class Flux2Codec:
    """Images float ``[B, 3, H, W]`` in [0, 1] <-> latents ``[B, 4C, H/(2f), W/(2f)]`` (f the VAE's
    downsampling) as ``Flux2KleinPipeline`` builds them: the posterior mode, 2 x 2 patchified, normalised by
    the VAE's batch-norm running statistics; decoding inverts it and maps [-1, 1] to [0, 1] (clamped)."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae.eval().requires_grad_(False)
        self.channels = 4 * int(vae.config.latent_channels)
        self.downsample = 2 * 2 ** (len(vae.config.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.channels, height // self.downsample, width // self.downsample)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        var = bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps
        return mean, torch.sqrt(var).to(like.device, like.dtype)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline as P

        z = P._patchify_latents(self.vae.encode((images * 2 - 1).to(self.vae.dtype)).latent_dist.mode()).float()
        mean, std = self._stats(z)
        return (z - mean) / std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline as P

        z = latents.to(self.vae.dtype)
        mean, std = self._stats(z)
        image = self.vae.decode(P._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return (image.float() * 0.5 + 0.5).clamp(0, 1)


class Flux2PromptEncoder(PipelinePromptEncoder):
    """``Flux2KleinPipeline.encode_prompt``: ``encode(prompts) -> PromptEmbeds(tokens [B,
    max_sequence_length, 3 D], pooled [B, 0])`` float32 on the CPU. ``encode([""])`` is the pipeline's
    negative prompt."""

    name = "flux2"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "flux2", path, max_sequence_length, dtype, device)
        self.dim = 3 * int(pipe.text_encoder.config.hidden_size)
        self.pooled_dim = 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        return tokens, tokens.new_zeros(tokens.shape[0], 0)


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a ``Flux2KleinPipeline`` folder: ``(Flux2Adapter, Flux2PromptEncoder, Flux2Codec, meta)``.

    ``options``: ``image_size`` (pixels; default the pipeline's 1024; a multiple of the VAE scale x 2),
    ``guidance_scale`` (default the pipeline's 4.0, 1.0 for a step-distilled folder),
    ``num_inference_steps`` (50), ``max_sequence_length`` (512), ``dtype`` ("float32", "bfloat16",
    "float16"; Qwen3 and the transformer load in it, the VAE stays float32). Raises ``ValueError`` naming
    the key for an unknown option, a bad size or dtype."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline

    path = Path(path)
    options, dtype = checked_options(options, OPTIONS, DTYPES, "FLUX.2 [klein]")
    defaults = call_defaults(Flux2KleinPipeline, "num_inference_steps", "max_sequence_length", "guidance_scale")
    vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    pipe = Flux2KleinPipeline.from_pretrained(str(path), vae=vae, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    if pipe.config.is_distilled:
        defaults["guidance_scale"] = 1.0
    factor = pipe.vae_scale_factor * 2
    size = check_image_size(int(options.get("image_size") or pipe.default_sample_size * pipe.vae_scale_factor), factor)
    model = Flux2Adapter(pipe.transformer.eval(), pipe.scheduler, (size // factor) ** 2)
    encoder = prompt_encoder_of(Flux2PromptEncoder, pipe, path, options, defaults, dtype, device)
    meta = family_meta("flux2", PIPELINE, COMPONENT, path, size, options, defaults)
    return model, encoder, Flux2Codec(pipe.vae), meta
