"""FLUX.1 pipeline folders (diffusers ``FluxPipeline``: ``FluxTransformer2DModel``, CLIP-L pooled + T5
token states, 16-channel ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler`` with dynamic shift), and
FLUX.1 Kontext folders (``FluxKontextPipeline``, Black Forest Labs 2025, arXiv 2506.15742: the same
components; the edit's source image enters as packed latents after the noisy ones in the sequence).

Our sampler's state stays the unpacked latents ``[B, 16, h, w]`` (the codec's latent shape); the adapter
packs them into the pipeline's 2x2-patch sequence ``[B, (h/2)(w/2), 64]`` for every forward and unpacks
the velocity. FLUX.1-dev is guidance-distilled (Black Forest Labs 2024): the guidance strength enters
as an embedding (``options["guidance"]``), never as two-branch CFG, so the family's CFG scale is 1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.backbone import Backbone, ConditioningError
from pretrain.codec import VAECodec
from pretrain.models.common import JOINT_ATTENTION, PipelinePromptEncoder, SchedulerTimestep
from pretrain.models.flow_schedule import dynamic_shift_sigmas
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
#: ``model.options`` defaults (FluxPipeline's: 28 steps, T5 length 512, embedded guidance 3.5).
DEFAULTS = {"guidance": 3.5, "max_sequence_length": 512, "num_inference_steps": 28, "dtype": "float32"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FluxAdapter(SchedulerTimestep, Backbone):
    """Wraps ``FluxTransformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) -> v``
    float32 ``[B, C, h, w]`` (h, w even).

    As ``FluxPipeline.__call__``: latents packed with ``_pack_latents``, image ids from
    ``_prepare_latent_image_ids``, text ids zero, timestep = (sigma * num_train_timesteps) / 1000 (the
    scheduler's timestep over 1000; the transformer multiplies by 1000 itself), ``guidance`` embedded when
    ``transformer.config.guidance_embeds`` (else None). ``image_seq_len`` (packed tokens of one image)
    sets the scheduler's dynamic shift in :meth:`sigmas`. Blocks (FSDP2 units): the double
    ``transformer_blocks``, then the ``single_transformer_blocks``; no sequence-parallel plan.

    ``takes_images`` (a Kontext folder): prompts may carry conditioning images (``embeds.images``, codec
    latents ``[B, C, h', w']``), packed as the latents are and appended to the sequence with image ids
    whose first axis is 1, as ``FluxKontextPipeline`` does; the velocity is read from the first (h/2)(w/2)
    tokens. Without it such prompts are refused (:class:`pretrain.backbone.Backbone`)."""

    lora_targets = JOINT_ATTENTION  # double blocks: image + text projections; single blocks: attn.to_q/k/v
    block_attrs = ("transformer_blocks", "single_transformer_blocks")

    @property
    def tp_plan(self) -> dict[str, str]:
        """diffusers' own ``FluxTransformer2DModel._tp_plan`` (colwise / rowwise projections in both block
        kinds), except the single blocks' packed ``proj_out``, which stays replicated behind an all-gather
        of its two input slices (``gather_input``, :mod:`pretrain.parallel.tensor`), and with the q / k
        RMS norms added as ``head_norm`` (their weights' gradients summed over the TP ranks; diffusers'
        plan leaves them plain, which is right for inference only), and with the AdaLN modulation
        projections sharded, their per-sample outputs gathered (``colwise_gather``). Raises
        ``ValueError`` when the installed diffusers has no plan."""
        plan = getattr(type(self.transformer), "_tp_plan", None)
        if not plan:
            raise ValueError(f"tensor parallel: {type(self.transformer).__name__} of this diffusers has no _tp_plan")
        styles = {k: v if isinstance(v, str) else "gather_input" if type(v).__name__ == "PackedRowwiseParallel"
                  else type(v).__name__ for k, v in plan.items()}  # an unknown style fails in expand_plan
        for blocks, names in (("transformer_blocks", ("norm_q", "norm_k", "norm_added_q", "norm_added_k")),
                              ("single_transformer_blocks", ("norm_q", "norm_k"))):
            styles.update({f"{blocks}.*.attn.{n}": "head_norm" for n in names})
        styles.update({p: "colwise_gather" for p in ("transformer_blocks.*.norm1.linear", "norm_out.linear",
                                                       "transformer_blocks.*.norm1_context.linear",
                                                       "single_transformer_blocks.*.norm.linear")})
        return styles

    def __init__(self, transformer: torch.nn.Module, scheduler, image_seq_len: int, guidance: float = 3.5,
                 takes_images: bool = False):
        super().__init__(transformer)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.image_seq_len = int(image_seq_len)
        self.guidance = float(guidance) if transformer.config.guidance_embeds else None
        self.takes_images = takes_images

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's schedule (:func:`pretrain.models.flow_schedule.dynamic_shift_sigmas` at this
        image's sequence length)."""
        return dynamic_shift_sigmas(self.scheduler_class, self.scheduler_config, self.image_seq_len,
                                    num_inference_steps, shift)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        from diffusers import FluxPipeline

        b, c, h, w = x.shape
        dtype, device = next(self.transformer.parameters()).dtype, x.device
        timestep = self.fed_timestep(sigma.to(device), dtype)
        guidance = None if self.guidance is None else torch.full([b], self.guidance, device=device)
        hidden = FluxPipeline._pack_latents(x.to(dtype), b, c, h, w)
        ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        n = hidden.shape[1]
        if embeds.images is not None:  # FluxKontextPipeline: the source's tokens after the latents, ids[:, 0] = 1
            cond = embeds.images.to(device, dtype)
            if cond.shape[0] != b or cond.dim() != 4:
                raise ConditioningError(f"FluxAdapter: conditioning images {tuple(cond.shape)} for {b} samples; expected "
                                 f"[{b}, C, h', w'] latents")
            ch, cw = cond.shape[-2:]
            cond_ids = FluxPipeline._prepare_latent_image_ids(b, ch // 2, cw // 2, device, dtype)
            cond_ids[..., 0] = 1
            hidden = torch.cat([hidden, FluxPipeline._pack_latents(cond, b, cond.shape[1], ch, cw)], dim=1)
            ids = torch.cat([ids, cond_ids])
        out = self.transformer(
            hidden_states=hidden, timestep=timestep,
            guidance=guidance, pooled_projections=embeds.pooled.to(device, dtype),
            encoder_hidden_states=embeds.tokens.to(device, dtype),
            txt_ids=torch.zeros(embeds.tokens.shape[1], 3, device=device, dtype=dtype),
            img_ids=ids, return_dict=False,
        )[0][:, :n]
        return FluxPipeline._unpack_latents(out.float(), h, w, 1)  # vae_scale_factor 1: sizes in latents


class FluxPromptEncoder(PipelinePromptEncoder):
    """``FluxPipeline.encode_prompt`` (CLIP ``pooler_output`` + T5 last hidden state padded to
    ``max_sequence_length``): ``encode(prompts) -> PromptEmbeds(tokens [B, L, D_t5], pooled [B, D_clip])``
    float32 on the CPU. ``pipe``: a ``FluxPipeline`` holding the text components. ``encode([""])`` is
    what the pipeline would build for an empty negative prompt (it uses none unless true CFG is on).
    ``cache_key``: unique per resolved folder, T5 length and dtype."""

    name = "flux"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "flux", path, max_sequence_length, dtype, device)
        self.dim = int(pipe.text_encoder_2.config.d_model)
        self.pooled_dim = int(pipe.text_encoder.config.hidden_size)

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, pooled, _ = self.pipe.encode_prompt(prompts, None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return tokens, pooled


#: The pipeline classes this module loads; a Kontext folder's prompts carry the source image.
PIPELINES = ("FluxPipeline", "FluxKontextPipeline")


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a ``FluxPipeline`` or ``FluxKontextPipeline`` folder: ``(FluxAdapter, FluxPromptEncoder,
    VAECodec, meta)``; a Kontext folder's adapter takes conditioning images (``takes_images``).

    ``options``: ``image_size`` (pixels, default the pipeline's 128 * vae_scale_factor; must be a
    multiple of vae_scale_factor * 2), ``guidance`` (embedded guidance, 3.5), ``max_sequence_length``
    (T5 tokens, 512), ``num_inference_steps`` (28), ``dtype`` ("float32", "bfloat16", "float16").
    Raises ``ValueError`` naming ``model.options.<key>`` for an unknown option, a bad size or dtype."""
    import diffusers
    from diffusers import FluxPipeline

    from pretrain.models.pipelines import pipeline_class

    path, opts = Path(path), {**DEFAULTS, **dict(options or {})}
    cls = pipeline_class(path) or "FluxPipeline"
    if cls not in PIPELINES:
        raise ValueError(f"{path}: pipeline class '{cls}' is not a FLUX.1 pipeline (known: {list(PIPELINES)})")
    unknown = sorted(set(opts) - set(DEFAULTS) - {"image_size"})
    if unknown:
        raise ValueError(f"model.options.{unknown[0]}: not an option of FLUX pipelines "
                         f"(known: {sorted({*DEFAULTS, 'image_size'})})")
    if opts["dtype"] not in DTYPES:
        raise ValueError(f"model.options.dtype: '{opts['dtype']}' is not one of {sorted(DTYPES)}")
    pipe = getattr(diffusers, cls).from_pretrained(str(path), dtype=DTYPES[opts["dtype"]]).to(device)
    factor = pipe.vae_scale_factor * 2
    size = int(opts.get("image_size") or pipe.default_sample_size * pipe.vae_scale_factor)
    if size % factor:
        raise ValueError(f"model.options.image_size: {size} is not divisible by {factor} "
                         f"(vae_scale_factor {pipe.vae_scale_factor} x 2x2 packing)")
    model = FluxAdapter(pipe.transformer.eval(), pipe.scheduler, (size // factor) ** 2, opts["guidance"],
                        takes_images=cls == "FluxKontextPipeline")
    text_pipe = FluxPipeline(scheduler=pipe.scheduler, vae=None, transformer=None,
                             text_encoder=pipe.text_encoder.eval().requires_grad_(False), tokenizer=pipe.tokenizer,
                             text_encoder_2=pipe.text_encoder_2.eval().requires_grad_(False),
                             tokenizer_2=pipe.tokenizer_2)
    text_pipe.set_progress_bar_config(disable=True)
    encoder = FluxPromptEncoder(text_pipe, path, opts["max_sequence_length"], opts["dtype"], device)
    meta = {"family": "flux", "pipeline": cls, "component": COMPONENT,
            "source": str(path), "image_size": size,
            "sampling": {"num_inference_steps": int(opts["num_inference_steps"]), "guidance_scale": 1.0,
                         "shift": None},
            "options": dict(options or {})}
    return model, encoder, VAECodec(pipe.vae), meta
