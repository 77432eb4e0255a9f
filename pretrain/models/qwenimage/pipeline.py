"""Qwen-Image pipeline folders (diffusers ``QwenImagePipeline``; Qwen team 2025, arXiv 2508.02324):
``QwenImageTransformer2DModel`` (an MMDiT with 3-axis RoPE), Qwen2.5-VL hidden states as text
conditioning, the ``AutoencoderKLQwenImage`` causal 3D VAE used one frame at a time, and a
``FlowMatchEulerDiscreteScheduler`` with a dynamic shift.

As the pipeline does:

- the sampler's state stays the unpacked latents ``[B, C, h, w]``; the adapter packs them into the
  2 x 2-patch sequence ``[B, (h/2)(w/2), 4C]`` for every forward (``img_shapes`` ``(1, h/2, w/2)``) and
  unpacks the velocity;
- the timestep is the scheduler's (sigma x 1000, float32) cast to the weights' dtype, over 1000;
- prompts go through the pipeline's own ``encode_prompt`` (its chat template, the template's first 34
  tokens dropped): variable-length states, zero after each prompt's length. We pad them with zeros to
  ``max_sequence_length`` so prompts cache and batch alike; the adapter cuts each batch back to its
  longest prompt and masks the rest (``encoder_hidden_states_mask``; None when no row is padded, as the
  pipeline passes it);
- classifier-free guidance ("true CFG", ``true_cfg_scale`` with a negative prompt) rescales each token
  of the guided velocity to the conditional branch's norm (:meth:`QwenImageAdapter.cfg_combine`).

Parallelism: tensor parallel with diffusers' plan plus the per-head norms (:attr:`QwenImageAdapter.tp_plan`);
context parallel with diffusers' ``_cp_plan`` (``parallel.cp``; the text then keeps its
``max_sequence_length``, masked, instead of being cut to the batch's longest prompt, and the CP degree must
divide it); no sequence-parallel plan.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.backbone import Backbone, ConditioningError
from pretrain.models.common import JOINT_ATTENTION, PipelinePromptEncoder, SchedulerTimestep, text_mask
from pretrain.models.flow_schedule import dynamic_shift_sigmas
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
PIPELINE = "QwenImagePipeline"
#: The pipeline classes this module loads (Qwen-Image-Edit: :mod:`pretrain.models.qwenimage.edit`).
PIPELINES = (PIPELINE, "QwenImageEditPipeline")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype", "condition_area")


class QwenImageAdapter(SchedulerTimestep, Backbone):
    """Wraps ``QwenImageTransformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v``
    float32 ``[B, C, h, w]`` (h, w even), ``embeds.tokens`` ``[B, L, D]`` zero-padded Qwen2.5-VL states,
    ``embeds.pooled`` ``[B, 0]`` unused. ``image_seq_len`` (packed tokens of one image) sets the
    scheduler's dynamic shift in :meth:`sigmas`. Blocks: ``transformer_blocks``.

    ``takes_images`` (a ``QwenImageEditPipeline`` folder, :mod:`pretrain.models.qwenimage.edit`): the
    prompts' source latents (``embeds.images`` ``[B, C, h', w']``) are packed and appended after the
    noisy latents' tokens with their own ``img_shapes`` entry, and the velocity is read from the first
    (h/2)(w/2) tokens, as the pipeline does."""

    lora_targets = JOINT_ATTENTION
    block_attrs = ("transformer_blocks",)
    tp_local_heads = False  # diffusers' processor takes head_dim = inner_dim / heads: the global count

    @property
    def tp_plan(self) -> dict[str, str]:
        """diffusers' own ``QwenImageTransformer2DModel._tp_plan`` (colwise q/k/v and MLP inputs, rowwise
        outputs, image and text streams alike; the AdaLN modulation stays replicated), with the per-head
        q / k RMS norms of both streams added as ``head_norm`` (their weight gradients summed over the TP
        ranks; diffusers' plan leaves them plain, which is right for inference only). Raises
        ``ValueError`` when the installed diffusers has no plan."""
        plan = getattr(type(self.transformer), "_tp_plan", None)
        if not plan:
            raise ValueError(f"tensor parallel: {type(self.transformer).__name__} of this diffusers has no _tp_plan")
        styles = dict(plan)
        styles.update({f"transformer_blocks.*.attn.{n}": "head_norm"
                       for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")})
        return styles

    def __init__(self, transformer: torch.nn.Module, scheduler, image_seq_len: int, takes_images: bool = False):
        super().__init__(transformer)
        self.takes_images = bool(takes_images)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.image_seq_len = int(image_seq_len)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's schedule (:func:`pretrain.models.flow_schedule.dynamic_shift_sigmas`)."""
        return dynamic_shift_sigmas(self.scheduler_class, self.scheduler_config, self.image_seq_len,
                                    num_inference_steps, shift)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        b, c, h, w = x.shape
        dtype, device = next(self.transformer.parameters()).dtype, x.device
        tokens = embeds.tokens.to(device)
        mask = text_mask(tokens)
        if getattr(self.transformer, "_parallel_config", None) is None:  # under CP the plan splits the text:
            length = max(int(mask.sum(1).max()), 1)  # it keeps max_sequence_length, which the CP degree divides
            tokens, mask = tokens[:, :length], mask[:, :length]
        if self.takes_images and embeds.images is None:
            raise ConditioningError("QwenImageAdapter: a Qwen-Image-Edit folder's prompts need their source images (data "
                             "with conditioning images, e.g. data.source: shapes_edit)")
        packed, shapes = pack(x.to(dtype)), [(1, h // 2, w // 2)]
        n = packed.shape[1]
        if embeds.images is not None:  # QwenImageEditPipeline: the source's tokens after the latents'
            cond = embeds.images.to(device, dtype)
            if cond.dim() != 4 or cond.shape[:2] != (b, c):
                raise ValueError(f"QwenImageAdapter: source latents {tuple(cond.shape)} for {b} samples of {c} "
                                 f"channels; expected [{b}, {c}, h', w']")
            packed = torch.cat([packed, pack(cond)], 1)
            shapes.append((1, cond.shape[2] // 2, cond.shape[3] // 2))
        out = self.transformer(hidden_states=packed, timestep=self.fed_timestep(sigma.to(device), dtype),
                               encoder_hidden_states=tokens.to(dtype),
                               encoder_hidden_states_mask=None if bool(mask.all()) else mask.long(),
                               img_shapes=[shapes] * b, guidance=None, return_dict=False)[0][:, :n]
        return out.float().view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def cfg_combine(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """``QwenImagePipeline``'s true CFG: g = v_uncond + w (v_cond - v_uncond), then each packed token
        (a 2 x 2 patch over all channels) of g rescaled to the norm of v_cond's: g * |v_cond| / |g|.
        ``[B, C, h, w]`` float32; ``guidance_scale`` 1 returns ``v_cond``."""
        if guidance_scale == 1.0:
            return v_cond
        b, c, h, w = v_cond.shape
        guided = (v_uncond + guidance_scale * (v_cond - v_uncond)).view(b, c, h // 2, 2, w // 2, 2)
        norm = lambda v: v.view(b, c, h // 2, 2, w // 2, 2).pow(2).sum((1, 3, 5), keepdim=True).sqrt()  # noqa: E731
        return (guided * (norm(v_cond) / norm(guided))).reshape(b, c, h, w)


def pack(x: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, C, h, w]`` (h, w even) -> the pipeline's 2 x 2-patch sequence ``[B, (h/2)(w/2), 4C]``."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, 4 * c)


class QwenImageCodec:
    """Images float ``[B, 3, H, W]`` in [0, 1] <-> latents ``[B, z_dim, H/8, W/8]`` through
    ``AutoencoderKLQwenImage`` as one-frame videos, normalised per channel as ``QwenImagePipeline``
    does: latents = (posterior mean - latents_mean) / latents_std; decoding inverts it and maps the VAE's
    [-1, 1] to [0, 1] (clamped). Encoding uses the posterior mean (deterministic); outputs float32."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.channels = int(cfg.z_dim)
        self.downsample = 2 ** len(cfg.temperal_downsample)
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, self.channels, 1, 1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, self.channels, 1, 1, 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.channels, height // self.downsample, width // self.downsample)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        pixels = (images[:, :, None] * 2 - 1).to(self.vae.device, self.vae.dtype)  # a source may sit on the CPU
        mean = self.vae.encode(pixels).latent_dist.mean.float()
        return ((mean - self.latents_mean.to(mean.device)) / self.latents_std.to(mean.device))[:, :, 0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents[:, :, None].to(self.vae.device, self.vae.dtype)
        inv_std = 1.0 / self.latents_std.to(z.device, z.dtype)
        image = self.vae.decode(z / inv_std + self.latents_mean.to(z.device, z.dtype), return_dict=False)[0][:, :, 0]
        return (image.float() * 0.5 + 0.5).clamp(0, 1)


class QwenImagePromptEncoder(PipelinePromptEncoder):
    """``QwenImagePipeline.encode_prompt``: ``encode(prompts) -> PromptEmbeds(tokens [B,
    max_sequence_length, D], pooled [B, 0])`` float32 on the CPU, each prompt's states then zeros
    (the adapter derives the attention mask from them); states beyond ``max_sequence_length`` are cut, as
    the pipeline cuts them. ``encode([""])`` is the empty negative prompt."""

    name = "qwenimage"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "qwenimage", path, max_sequence_length, dtype, device)
        self.dim = int(pipe.text_encoder.config.text_config.hidden_size)
        self.pooled_dim = 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        padded = tokens.new_zeros(tokens.shape[0], self.max_sequence_length, tokens.shape[2])
        padded[:, :tokens.shape[1]] = tokens
        return padded, tokens.new_zeros(tokens.shape[0], 0)
