"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``) and SDXL (``StableDiffusionXLPipeline``)
folders: a ``UNet2DConditionModel`` predicting epsilon (or v / x0) under a DDPM-type schedule, behind
the flow-matching backbone interface.

The state is the flow state y = x_t / (alpha_t + s_t) at sigma = s_t / (alpha_t + s_t); the adapter
feeds the UNet x_t = y / sqrt((1 - sigma)^2 + sigma^2) at the scheduler timestep of sigma and returns
v = eps_hat - x0_hat. The derivation, and why our Euler ODE sampler then walks exactly the pipeline's
DDIM (eta 0) or Euler discrete steps, is in :mod:`pretrain.models.unet.vp_schedule`.

Conditioning, as the pipelines' ``encode_prompt`` and ``__call__`` build it:

- SD 1.x / 2.x: tokens = CLIP last hidden states ``[B, 77, D]`` (the pipeline's ``encode_prompt``,
  ``clip_skip`` None); pooled = an empty ``[B, 0]``. The unconditional embedding is the encoding of ""
  (what the pipeline uses when no negative prompt is given).
- SDXL: tokens = the concatenated penultimate states of CLIP-L and CLIP-G ``[B, 77, D1 + D2]``;
  pooled = CLIP-G's projected text embedding ``[B, P]`` (the UNet's ``text_embeds``); ``time_ids`` =
  (H, W, 0, 0, H, W) at the run's image size (``_get_add_time_ids`` with original = target size, crop
  (0, 0)). With ``force_zeros_for_empty_prompt`` (SDXL's default) the empty prompt encodes to zeros:
  that is the pipeline's negative embedding when none is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.backbone import Backbone
from pretrain.codec import VAECodec
from pretrain.models.common import PipelinePromptEncoder, call_defaults, checked_options, family_meta
from pretrain.models.unet.vp_schedule import VPSchedule, flow_velocity, vp_state
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "unet"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNET_ATTENTION = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "dtype", "scheduler")
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}


class UNetAdapter(Backbone):
    """``forward(x [B, C, h, w] flow state, sigma [B] in [0, 1], embeds) -> velocity float32``
    around a ``UNet2DConditionModel`` (``self.transformer``, the interface's name). ``schedule``: the
    folder scheduler's :class:`VPSchedule`; ``time_ids``: SDXL's ``[1, 6]`` added time ids, None for SD
    1.x / 2.x. Blocks (FSDP2 units): ``down_blocks``, ``mid_block``, ``up_blocks``; no sequence-parallel
    plan."""

    lora_targets = UNET_ATTENTION
    block_attrs = ("down_blocks", "mid_block", "up_blocks")

    def __init__(self, unet: torch.nn.Module, schedule: VPSchedule, time_ids: torch.Tensor | None = None):
        super().__init__(unet)
        self.schedule, self.time_ids = schedule, time_ids

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline scheduler's sigmas in flow coordinates, float32 ``[n + 1]`` ending at 0.
        ``shift`` must be None (or 1): the scheduler owns the schedule; ``ValueError`` otherwise."""
        if shift not in (None, 1, 1.0):
            raise ValueError(f"the UNet family samples its scheduler's timesteps; shift must be null, got {shift}")
        return self.schedule.sigmas(num_inference_steps)

    def initial_scale(self, sigma0: float) -> float:
        """y0 = noise * scale reproduces the pipeline's ``latents * init_noise_sigma`` (see
        :meth:`VPSchedule.initial_scale`)."""
        return self.schedule.initial_scale(sigma0)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The scheduler timestep of the VP state at flow ``sigma`` (:meth:`VPSchedule.timestep`)."""
        return self.schedule.timestep(sigma.to(torch.float32)).float()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        sigma = sigma.to(x.device, torch.float32).expand(x.shape[0])
        added = None
        if self.time_ids is not None:
            added = {"text_embeds": embeds.pooled.to(x.device, dtype),
                     "time_ids": self.time_ids.to(x.device, dtype).expand(x.shape[0], -1)}
        pred = self.transformer(vp_state(x.float(), sigma).to(dtype), self.schedule.timestep(sigma),
                                encoder_hidden_states=embeds.tokens.to(x.device, dtype), added_cond_kwargs=added,
                                return_dict=False)[0]
        return flow_velocity(pred, x, sigma, self.schedule.prediction_type)


class UNetPromptEncoder(PipelinePromptEncoder):
    """Prompts -> :class:`PromptEmbeds` float32 with the pipeline's own ``encode_prompt`` (``pipe``: the
    pipeline without UNet and VAE): SD tokens ``[B, 77, D]`` and pooled ``[B, 0]``; SDXL tokens
    ``[B, 77, D1 + D2]`` and pooled ``[B, P]``. ``encode([""])`` is the pipeline's negative embedding when
    no negative prompt is given (zeros for SDXL with ``force_zeros_for_empty_prompt``). ``cache_key``:
    unique per resolved folder and dtype (:func:`common.folder_cache_key`)."""

    name = "unet"

    def __init__(self, pipe, path: Path, dtype: str, device: str):
        super().__init__(pipe, "unet", path, pipe.tokenizer.model_max_length, dtype, device)
        self.xl = hasattr(pipe, "text_encoder_2")
        self.zero_empty = self.xl and bool(pipe.config.force_zeros_for_empty_prompt)
        encoders = [pipe.text_encoder, pipe.text_encoder_2] if self.xl else [pipe.text_encoder]
        self.dim = sum(int(e.config.hidden_size) for e in encoders)
        self.pooled_dim = int(pipe.text_encoder_2.config.projection_dim) if self.xl else 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                      do_classifier_free_guidance=False)
        tokens = enc[0]
        pooled = enc[2] if self.xl else tokens.new_zeros(len(prompts), 0)
        if self.zero_empty:
            keep = torch.tensor([p != "" for p in prompts], device=tokens.device, dtype=tokens.dtype)
            tokens, pooled = tokens * keep[:, None, None], pooled * keep[:, None]
        return tokens, pooled


def _scheduler(pipe, choice: str | None):
    """The folder's scheduler, or (``choice`` "ddim" / "euler") that scheduler built from its config
    (DDIM with ``set_alpha_to_one`` and no clipping, so it ends at sigma 0)."""
    if choice is None:
        return pipe.scheduler
    import diffusers

    if choice not in SCHEDULERS:
        raise ValueError(f"model.options.scheduler: '{choice}' is not one of {sorted(SCHEDULERS)}")
    extra = {"set_alpha_to_one": True, "clip_sample": False, "thresholding": False} if choice == "ddim" else {}
    return getattr(diffusers, SCHEDULERS[choice]).from_config(pipe.scheduler.config, **extra)


def finalize_export(folder: Path, meta: dict) -> None:
    """For a run with ``model.options.scheduler``: replace the export's ``scheduler/`` (copied, hard-linked,
    from the source) and its ``model_index.json`` entry by the scheduler the run sampled with, so ``from_pretrained(export)`` samples as
    our sampler does. The copied files are unlinked first, never written through to the source."""
    choice = meta.get("options", {}).get("scheduler")
    if not choice:
        return
    import json
    import shutil
    from types import SimpleNamespace

    import diffusers

    sub = Path(folder) / "scheduler"
    cls = getattr(diffusers, json.loads((sub / "scheduler_config.json").read_text())["_class_name"])
    scheduler = _scheduler(SimpleNamespace(scheduler=cls.from_pretrained(str(sub))), choice)
    shutil.rmtree(sub)
    scheduler.save_pretrained(str(sub))
    index_path = Path(folder) / "model_index.json"  # the pipeline picks the scheduler class from here
    index = json.loads(index_path.read_text())
    index["scheduler"] = ["diffusers", type(scheduler).__name__]
    index_path.unlink()
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def load(path: Path, device: str, options: dict):
    """Load a ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` folder:
    ``(UNetAdapter, UNetPromptEncoder, VAECodec, meta)``.

    ``options``: ``image_size`` (pixels; default UNet sample_size x VAE factor: 512 SD 1.5, 1024 SDXL),
    ``guidance_scale`` / ``num_inference_steps`` (defaults: the pipeline's ``__call__`` defaults, 7.5 SD
    and 5.0 SDXL / 50), ``dtype`` (of the UNet and text encoders, one of :data:`DTYPES`, default
    float32; the VAE stays float32), ``scheduler`` (None = the folder's; "ddim" / "euler": built from
    the folder's scheduler config). Raises ``ValueError`` for an unknown option or dtype, an unsupported
    scheduler (:func:`vp_schedule.check_scheduler`), a guidance-embedding (LCM) UNet or a VAE with
    latents_mean / latents_std."""
    import diffusers
    from diffusers import AutoencoderKL, UNet2DConditionModel

    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    name = index["_class_name"]
    options, dtype = checked_options(options, OPTIONS, DTYPES, name)
    pipe_cls = getattr(diffusers, name)
    skip = {k: None for k in ("unet", "vae", "safety_checker", "feature_extractor", "image_encoder") if k in index}
    pipe = pipe_cls.from_pretrained(path, dtype=DTYPES[dtype], **skip).to(device)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", dtype=DTYPES[dtype]).to(device).eval()
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae").to(device)
    if unet.config.time_cond_proj_dim is not None:
        raise ValueError(f"{path}: UNet with time_cond_proj_dim (guidance embedding, LCM) is not supported")
    if getattr(vae.config, "latents_mean", None) is not None:
        raise ValueError(f"{path}: a VAE with latents_mean / latents_std is not supported (scaling factor only)")
    schedule = VPSchedule(_scheduler(pipe, options.get("scheduler")))
    codec = VAECodec(vae)
    size = int(options.get("image_size") or unet.config.sample_size * codec.downsample)
    encoder = UNetPromptEncoder(pipe, path, dtype, device)
    time_ids = None
    if unet.config.addition_embed_type == "text_time":
        time_ids = torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32)
        expected = unet.add_embedding.linear_1.in_features
        if unet.config.addition_time_embed_dim * 6 + encoder.pooled_dim != expected:
            raise ValueError(f"{path}: the UNet expects {expected} added-embedding features, the text encoder "
                             f"gives {encoder.pooled_dim} + 6 x {unet.config.addition_time_embed_dim}")
    meta = family_meta("unet", name, COMPONENT, path, size, options,
                       call_defaults(pipe_cls, "guidance_scale", "num_inference_steps"))
    return UNetAdapter(unet, schedule, time_ids), encoder, codec, meta
