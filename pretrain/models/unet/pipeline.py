"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``) and SDXL (``StableDiffusionXLPipeline``)
folders: a ``UNet2DConditionModel`` predicting epsilon (or v / x0) under a DDPM-type schedule, behind
the flow-matching backbone interface through :class:`pretrain.models.unet.adapter.UNetAdapter`.

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

from pretrain.codec import VAECodec
from pretrain.models.common import PipelinePromptEncoder, call_defaults, checked_options, family_meta
from pretrain.models.unet.adapter import UNetAdapter
from pretrain.models.unet.vp_schedule import VPSchedule

COMPONENT = "unet"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "dtype", "scheduler")
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}


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
