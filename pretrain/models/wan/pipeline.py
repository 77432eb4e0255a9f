"""Wan2.1 text-to-video pipeline folders (diffusers ``WanPipeline``; Wan team 2025, arXiv 2503.20314).

The denoiser is ``WanTransformer3DModel`` on video latents ``[B, 16, F', h, w]``; it predicts the flow
velocity eps - x0 at timestep = sigma * ``num_train_timesteps`` (1000: ``WanPipeline`` passes the
scheduler's ``timesteps``, float32 for ``FlowMatchEulerDiscreteScheduler``). Prompts go through the
pipeline's own ``encode_prompt`` (UMT5-XXL, zero-padded to ``max_sequence_length``); there is no pooled
embedding. Latents through ``AutoencoderKLWan`` (:class:`pretrain.models.wan.codec.WanVideoCodec`).

Sampling. Our samplers are the Euler ODE and the Flow-GRPO SDE. For a folder whose scheduler is
``FlowMatchEulerDiscreteScheduler`` we walk exactly its sigmas, so our ODE equals the pipeline (the
tests prove it on a tiny pipeline). The released Wan2.1 folders ship ``UniPCMultistepScheduler``
(``use_flow_sigmas``, ``flow_shift`` 3.0 for 480p): we take its flow-shifted linear sigmas but step them
with Euler/SDE, not UniPC's multistep predictor-corrector, so results are close to, not equal to, the
pipeline's.

Wan2.2. A TI2V-5B folder (``expand_timesteps``: the pipeline hands the transformer one timestep per
latent token, ``[B, F' * h/2 * w/2]``, rather than one per sample; its VAE packs 2 x 2 pixels into channels
and downsamples by 16) samples text-to-video here with that per-token timestep, every token at the
step's timestep as ``WanPipeline`` gives it without a conditioning image. An A14B folder
(``transformer_2`` switched in below ``boundary_ratio * num_train_timesteps``) loads as
:class:`WanExpertsAdapter` over :class:`pretrain.models.wan.experts.WanExperts`: the step's expert is
the pipeline's, rollouts record it, and a recomputation that would use another raises. One guidance
scale for both experts (the pipeline's default; ``guidance_scale_2`` is not modelled).

Image-to-video. A ``WanImageToVideoPipeline`` folder without an image encoder (Wan2.2 I2V-A14B, or one
transformer) takes each prompt's first frame as a condition concatenated to the latents along channels
(:class:`pretrain.models.wan.codec.WanImageToVideoCodec`; prompts carry it as ``PromptEmbeds.images``,
rollouts record it): the transformer's ``in_channels`` are 2 z + T (latents, frame mask, condition
latents). Wan2.1 I2V (CLIP image embeddings) and TI2V-5B's image mode are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.backbone import ConditioningError
from pretrain.models.common import (PipelinePromptEncoder, call_defaults, check_image_size, checked_options,
                                      family_meta)
from pretrain.models.flow_schedule import checked_schedule, set_flow_timesteps
from pretrain.models.wan.codec import WanImageToVideoCodec, WanVideoCodec, check_num_frames
from pretrain.models.wan.experts import WanExperts
from pretrain.models.wan.model import WanVideoAdapter

COMPONENT = "transformer"
PIPELINE = "WanPipeline"
#: The pipeline classes this module loads; an image-to-video folder's prompts carry their first frame.
PIPELINES = (PIPELINE, "WanImageToVideoPipeline")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "num_frames", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype",
           "text_encoder_dtype", "schedule")


def scheduler_sigmas(scheduler_class, config: dict, num_inference_steps: int, shift: float | None = None,
                     schedule: str = "pipeline") -> torch.Tensor:
    """The sigmas a Wan pipeline's scheduler walks for ``num_inference_steps``, final 0 included:
    float32 ``[num_inference_steps + 1]`` from the scheduler's own ``set_timesteps``.

    ``FlowMatchEulerDiscreteScheduler``: its ``sigmas`` as is (``shift`` not None replaces its
    ``shift``), or with ``schedule`` "single_shift" shifted once (:mod:`pretrain.models.flow_schedule`,
    diffusers#13243). ``UniPCMultistepScheduler`` with ``use_flow_sigmas``: its flow-shifted linear
    sigmas (shifted once already, so ``schedule`` changes nothing; ``shift`` replaces ``flow_shift``),
    with the first sigma put back to exactly 1 where UniPC nudges it to 1 - 1e-6 (only to avoid log(0)
    in its multistep update; the SDE's std at sigma = 1 must use the next sigma, not divide by 1e-6). Raises ``ValueError`` for steps < 1, another scheduler,
    UniPC without flow sigmas, or dynamic shifting (WanPipeline passes no ``mu``)."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    name, cfg = scheduler_class.__name__, dict(config)
    if name not in ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler"):
        raise ValueError(f"Wan scheduler '{name}' is not supported (FlowMatchEulerDiscreteScheduler, "
                         f"UniPCMultistepScheduler with use_flow_sigmas)")
    if name == "UniPCMultistepScheduler" and not cfg.get("use_flow_sigmas"):
        raise ValueError("UniPCMultistepScheduler without use_flow_sigmas is not a flow-matching schedule")
    if cfg.get("use_dynamic_shifting"):
        raise ValueError(f"{name} with use_dynamic_shifting: WanPipeline passes no mu")
    if shift is not None:
        cfg["shift" if name == "FlowMatchEulerDiscreteScheduler" else "flow_shift"] = float(shift)
    scheduler = scheduler_class.from_config(cfg)
    if name == "FlowMatchEulerDiscreteScheduler":
        set_flow_timesteps(scheduler, num_inference_steps, schedule)
    else:
        scheduler.set_timesteps(num_inference_steps, device="cpu")
    sigmas = scheduler.sigmas.to(torch.float32).clone()
    if name == "UniPCMultistepScheduler" and abs(float(sigmas[0]) - 1.0) < 1e-5:
        sigmas[0] = 1.0
    return sigmas


class WanAdapter(WanVideoAdapter):
    """:class:`pretrain.models.wan.model.WanVideoAdapter` (``forward(x [B, C, F', h, w], sigma [B] in [0, 1],
    embeds) -> velocity`` float32, the transformer's prediction v = eps - x0 at the float32 timestep
    sigma * ``num_train_timesteps`` as ``WanPipeline`` passes it; ``embeds.pooled`` ``[B, 0]`` unused)
    walking the folder scheduler's sigmas (:func:`scheduler_sigmas`, ``schedule`` "pipeline" or
    "single_shift"). ``expand_timesteps`` (Wan2.2 TI2V): the timestep goes in per latent token, float32
    ``[B, F' * ceil(h / 2) * ceil(w / 2)]``, each row the sample's timestep, as ``WanPipeline`` builds it
    from its all-ones text-to-video mask."""

    def __init__(self, transformer: torch.nn.Module, scheduler, schedule: str = "pipeline",
                 expand_timesteps: bool = False, takes_images: bool = False):
        super().__init__(transformer)
        self.takes_images = bool(takes_images)
        self.scheduler_class = type(scheduler)
        self.scheduler_config = dict(scheduler.config)
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.schedule = checked_schedule({"schedule": schedule})
        self.expand_timesteps = bool(expand_timesteps)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        return scheduler_sigmas(self.scheduler_class, self.scheduler_config, num_inference_steps, shift,
                                self.schedule)

    def transformer_input(self, x: torch.Tensor, embeds) -> torch.Tensor:
        """``x`` ``[B, C, F', h, w]``, with an image-to-video folder's conditions (``embeds.images``,
        :meth:`pretrain.models.wan.codec.WanImageToVideoCodec.encode_conditions`, ``[B, T + C, F', h, w]``)
        concatenated after it along channels, as ``WanImageToVideoPipeline`` feeds its transformer.
        ``ConditioningError`` (a ``ValueError``) when an image-to-video folder's prompts carry none, or when the
        conditions' batch or frame grid differs from ``x``'s."""
        cond = embeds.images
        if cond is None and self.takes_images:
            raise ConditioningError("WanAdapter: an image-to-video folder's prompts need their first frames (data "
                                    "with conditioning images, or `posttrain sample --images`)")
        if cond is None:
            return x
        if cond.dim() != 5 or cond.shape[0] != x.shape[0] or cond.shape[2:] != x.shape[2:]:
            raise ConditioningError(f"WanAdapter: conditions {tuple(cond.shape)} for latents {tuple(x.shape)}; expected "
                             f"[{x.shape[0]}, T + C, {', '.join(map(str, x.shape[2:]))}] (the image-to-video codec's "
                             f"encode_conditions)")
        return torch.cat([x, cond.to(x.device, x.dtype)], 1)

    def sequence_parallel(self, group) -> list:
        """The Wan Ulysses plan; ``ValueError`` for ``expand_timesteps`` (the per-token timestep
        embedding is not split with the tokens)."""
        if self.expand_timesteps:
            raise ValueError("sequence parallel: a Wan2.2 TI2V folder (expand_timesteps: per-token timesteps) "
                             "has no sequence-parallel plan; set parallel.sp=1")
        return super().sequence_parallel(group)

    def transformer_timestep(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        timestep = super().transformer_timestep(x, sigma)
        if not self.expand_timesteps:
            return timestep
        frames, h, w = x.shape[2], (x.shape[3] + 1) // 2, (x.shape[4] + 1) // 2  # the pipeline's mask[:, ::2, ::2]
        return timestep[:, None].expand(-1, frames * h * w)


class WanExpertsAdapter(WanAdapter):
    """:class:`WanAdapter` over Wan2.2 A14B's two experts (``transformer``:
    :class:`pretrain.models.wan.experts.WanExperts`), which routes each row by its timestep as
    ``WanPipeline`` does. FSDP2 wraps both experts' blocks; no tensor or sequence parallel plan."""

    tp_plan = None

    def experts(self, sigma: torch.Tensor) -> torch.Tensor:
        """long ``[T]``: 0 where the step at ``sigma`` goes to the high-noise ``transformer``, 1 where it
        goes to ``transformer_2``."""
        return self.transformer.expert_of(self.timestep(sigma))

    @classmethod
    def blocks_of(cls, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        return [b for part in denoiser.components().values() for b in WanAdapter.blocks_of(part)]

    def sequence_parallel(self, group) -> list:
        raise ValueError("sequence parallel: a Wan2.2 A14B folder (two experts) has no sequence-parallel plan; "
                         "set parallel.sp=1")


class WanPromptEncoder(PipelinePromptEncoder):
    """Prompts -> ``PromptEmbeds`` as ``WanPipeline.encode_prompt`` builds them: tokens float32
    ``[B, max_sequence_length, D]`` (UMT5 last hidden states of the cleaned prompt, zeroed after its
    length), pooled float32 ``[B, 0]``. ``encode([""])`` is the pipeline's unconditional embedding when
    no negative prompt is given. Outputs are on the CPU; ``cache_key`` unique per resolved folder,
    length and text-encoder dtype."""

    name = "wan_umt5"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "wan", path, max_sequence_length, dtype, device)
        self.dim = int(pipe.text_encoder.config.d_model)
        self.pooled_dim = 0

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        return tokens, tokens.new_zeros(tokens.shape[0], 0)


def check_folder(path: Path) -> bool:
    """True for a Wan2.2 A14B folder (``transformer_2`` and ``boundary_ratio``), False for one transformer.
    ``ValueError`` for one without the other, or for a folder without ``transformer``."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    present = lambda name: bool(index.get(name) and index[name][0])  # noqa: E731  (["diffusers", cls] or [null, null])
    two, boundary = present("transformer_2"), index.get("boundary_ratio") is not None
    if not present("transformer"):
        raise ValueError(f"{path}: a Wan pipeline without 'transformer' (only transformer_2) is not supported")
    if two != boundary:
        raise ValueError(f"{path}: a Wan2.2 A14B pipeline needs both transformer_2 and boundary_ratio, got "
                         f"transformer_2 {'set' if two else 'unset'}, boundary_ratio {index.get('boundary_ratio')}")
    return two


def check_image_to_video(path: Path) -> None:
    """``ValueError``, before anything loads, for the ``WanImageToVideoPipeline`` folders not modelled: a
    CLIP image encoder (Wan2.1 I2V's ``image_dim``) or ``expand_timesteps`` (Wan2.2 TI2V-5B's image mode,
    which overwrites the first latent frame instead of concatenating a condition); and for a transformer
    whose ``in_channels`` is not 2 z + T (latents, frame mask, condition latents)."""
    read = lambda *p: json.loads(Path(path, *p).read_text())  # noqa: E731
    index, vae = read("model_index.json"), read("vae", "config.json")
    configs = [read(name, "config.json") for name in ("transformer", "transformer_2")
               if index.get(name) and index[name][0]]
    if (index.get("image_encoder") or [None])[0] or any(c.get("image_dim") for c in configs):
        raise ValueError("WanImageToVideoPipeline with a CLIP image encoder (Wan2.1 I2V, transformer image_dim) is "
                         "not supported: the conditioning here is the first frame's latents (Wan2.2 I2V-A14B)")
    if index.get("expand_timesteps"):
        raise ValueError("WanImageToVideoPipeline with expand_timesteps (Wan2.2 TI2V-5B image-to-video) is not "
                         "supported; its text-to-video mode loads as a WanPipeline folder")
    want = 2 * vae["z_dim"] + vae.get("scale_factor_temporal", 4)
    if any(c["in_channels"] != want for c in configs):
        raise ValueError(f"WanImageToVideoPipeline: transformer in_channels {[c['in_channels'] for c in configs]}, "
                         f"expected {want} (latents + frame mask + condition latents)")


def load(path: Path, device: str, options: dict):
    """Load a ``WanPipeline`` or ``WanImageToVideoPipeline`` folder: ``(model, encoder, codec, meta)``; an
    image-to-video folder's adapter takes conditioning images (the first frame,
    :class:`pretrain.models.wan.codec.WanImageToVideoCodec`; :func:`check_image_to_video` names the
    variants refused).

    ``options``: ``image_size`` (square side in pixels; default the pipeline's height, 480),
    ``num_frames`` (4k + 1; default 81), ``guidance_scale`` (5.0), ``num_inference_steps`` (50),
    ``max_sequence_length`` (512), ``dtype`` of the transformer ("float32", "bfloat16", "float16";
    default float32; LoRA adapters are created in it), ``text_encoder_dtype`` of UMT5 (default
    ``dtype``; "bfloat16" halves the 5.7 B-parameter encoder, as Wan ships it). The VAE stays float32,
    as Wan's examples load it; ``schedule`` ("pipeline" or "single_shift", see :func:`scheduler_sigmas`).
    Raises ``ValueError`` for an unknown option, dtype or schedule, a frame count that is not 4k + 1,
    an image size the VAE scale x patch size does not divide, or a folder :func:`check_folder` refuses."""
    import diffusers
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    from pretrain.models.pipelines import pipeline_class

    cls = pipeline_class(path) or PIPELINE
    if cls not in PIPELINES:
        raise ValueError(f"{path}: pipeline class '{cls}' is not a Wan pipeline (known: {list(PIPELINES)})")
    pipeline_cls, i2v = getattr(diffusers, cls), cls != PIPELINE
    options, dtype = checked_options(options, OPTIONS, DTYPES, "Wan")
    schedule = checked_schedule(options)
    text_dtype = options.get("text_encoder_dtype", dtype)
    if text_dtype not in DTYPES:
        raise ValueError(f"model.options.text_encoder_dtype: '{text_dtype}' is not one of {sorted(DTYPES)}")
    two_experts = check_folder(path)
    if i2v:
        check_image_to_video(path)
    defaults = call_defaults(pipeline_cls, "height", "num_frames", "num_inference_steps", "guidance_scale",
                             "max_sequence_length")
    vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    num_frames = check_num_frames(options.get("num_frames", defaults["num_frames"]), vae.config.scale_factor_temporal)
    text_encoder = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", dtype=DTYPES[text_dtype])
    pipe = pipeline_cls.from_pretrained(path, vae=vae, text_encoder=text_encoder, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    image_size = check_image_size(int(options.get("image_size") or defaults["height"]),
                                  pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1])
    expand = bool(pipe.config.get("expand_timesteps"))
    if two_experts:
        boundary = float(pipe.config.boundary_ratio) * pipe.scheduler.config.num_train_timesteps
        experts = WanExperts(pipe.transformer.eval(), pipe.transformer_2.eval(), boundary)
        model = WanExpertsAdapter(experts, pipe.scheduler, schedule, expand, takes_images=i2v)
    else:
        model = WanAdapter(pipe.transformer.eval(), pipe.scheduler, schedule, expand, takes_images=i2v)
    encoder = WanPromptEncoder(pipe, path, int(options.get("max_sequence_length", defaults["max_sequence_length"])),
                               text_dtype, device)
    meta = family_meta("wan", cls, COMPONENT, path, image_size, options, defaults)
    return model, encoder, (WanImageToVideoCodec if i2v else WanVideoCodec)(pipe.vae, num_frames), meta
