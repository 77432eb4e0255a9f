"""HiDream-I1 pipeline folders (diffusers ``HiDreamImagePipeline``; HiDream.ai 2025, arXiv 2505.22705): a
sparse diffusion transformer whose feed-forward layers are mixtures of experts (``MOEFeedForwardSwiGLU``:
a shared expert plus ``num_activated_experts`` of ``num_routed_experts`` routed ones, chosen per token by
a softmax gate, DeepSeek-V3's layout), conditioned on CLIP-L + CLIP-G pooled vectors, T5-XXL states and
the hidden states of every Llama-3.1 layer (each block reads its own layer, ``llama_layers``).

As the pipeline does:

- the sampler's state is the VAE latents ``[B, C, h, w]`` (the transformer patchifies them itself);
- the timestep is the scheduler's, sigma x 1000 in float32; the transformer predicts minus the flow
  velocity (the pipeline negates its output), so the adapter negates it too;
- prompts go through the pipeline's own ``encode_prompt``; we keep the T5 states and every Llama layer's
  states in one token tensor ``[B, L_t5 + n_layers * L_llama, D]`` (zero-padded to the wider of the two
  widths; :meth:`HiDreamAdapter.split` undoes it), pooled = [CLIP-L, CLIP-G] projections;
- the pipeline renders every request at ``default_sample_size * vae_scale_factor`` squared pixels (its
  ``S_max`` rescaling), 1024 x 1024 for the released folders: the default ``image_size``. Another size
  samples here but is not what the pipeline would draw.

Two quirks of diffusers' transformer the adapter hides: in ``train()`` mode (unless the folder sets
``force_inference_output``) it returns its output as ``[B, C, S, p * p]`` patches rather than the image,
which the adapter folds back; and in ``eval()`` mode its routed experts run under ``torch.no_grad``
(``moe_infer``), so a forward that needs gradients would silently train only the shared experts: the
adapter switches the MoE layers to their training path whenever gradients are enabled.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pretrain.backbone import Backbone
from pretrain.codec import VAECodec
from pretrain.models.common import PipelinePromptEncoder, call_defaults, check_image_size, checked_options, family_meta
from pretrain.text_encoder import PromptEmbeds

COMPONENT = "transformer"
PIPELINE = "HiDreamImagePipeline"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = ("image_size", "guidance_scale", "num_inference_steps", "max_sequence_length", "dtype")
#: Attention projections of the image stream (every block) and the text stream (double-stream blocks).
HIDREAM_ATTENTION = [f"attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t")]


def hidream_sigmas(scheduler_class, config: dict, max_seq: int, num_inference_steps: int,
                   shift: float | None = None) -> torch.Tensor:
    """The sigmas ``HiDreamImagePipeline`` walks, float32 ``[n + 1]`` ending in 0: a fresh
    ``FlowMatchEulerDiscreteScheduler`` from ``config`` (``shift`` replacing its shift when not None)
    ``set_timesteps(n, mu=calculate_shift(max_seq))`` (``mu`` is read only with ``use_dynamic_shifting``).
    ``ValueError`` for another scheduler or ``n < 1``."""
    from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift

    if scheduler_class.__name__ != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"HiDream scheduler '{scheduler_class.__name__}' is not supported "
                         f"(FlowMatchEulerDiscreteScheduler)")
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    scheduler = scheduler_class.from_config({**config, **({} if shift is None else {"shift": float(shift)})})
    scheduler.set_timesteps(num_inference_steps, device="cpu", mu=calculate_shift(max_seq))
    return scheduler.sigmas.to(torch.float32).clone()


def _moe_layers(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU, MoEGate

    return [m for m in transformer.modules() if isinstance(m, (MOEFeedForwardSwiGLU, MoEGate))]


class HiDreamAdapter(Backbone):
    """Wraps ``HiDreamImageTransformer2DModel``: ``forward(x [B, C, h, w], sigma [B] in [0, 1], embeds) ->
    velocity`` float32 ``[B, C, h, w]`` (h = w, a multiple of the patch size). ``embeds.tokens``: see
    :meth:`split`; ``embeds.pooled`` ``[B, P]`` the CLIP projections. Blocks (FSDP2 units): the
    double-stream then the single-stream blocks; no tensor, sequence or context parallel plan; expert
    parallelism (``parallel.ep``) over :meth:`moe_layers`."""

    lora_targets = HIDREAM_ATTENTION
    block_attrs = ("double_stream_blocks", "single_stream_blocks")
    tp_plan = None

    def __init__(self, transformer: torch.nn.Module, scheduler, t5_len: int, t5_dim: int, llama_dim: int,
                 llama_layers: int):
        super().__init__(transformer)
        self.scheduler_class, self.scheduler_config = type(scheduler), dict(scheduler.config)
        self.t5_len, self.t5_dim, self.llama_dim = int(t5_len), int(t5_dim), int(llama_dim)
        self.llama_layers = int(llama_layers)
        self._moe = _moe_layers(transformer)  # found once: the forward toggles them

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        return hidream_sigmas(self.scheduler_class, self.scheduler_config, self.transformer.max_seq,
                              num_inference_steps, shift)

    def moe_layers(self) -> list[torch.nn.Module]:
        """Every ``MOEFeedForwardSwiGLU`` (the image stream's ``ff_i`` of each block)."""
        return [m for m in self._moe if hasattr(m, "experts")]

    def split(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[B, L_t5 + n * L, D]`` -> (T5 states ``[B, L_t5, D_t5]``, Llama states of every layer
        ``[n, B, L, D_llama]``, the pipeline's layout)."""
        b, total, _ = tokens.shape
        n = self.llama_layers
        if total <= self.t5_len or (total - self.t5_len) % n:
            raise ValueError(f"HiDreamAdapter: {total} tokens are not {self.t5_len} T5 tokens + {n} Llama layers of "
                             f"equal length (HiDreamPromptEncoder's layout)")
        llama = tokens[:, self.t5_len:, :self.llama_dim]
        return tokens[:, :self.t5_len, :self.t5_dim], llama.reshape(b, n, -1, self.llama_dim).transpose(0, 1)

    @contextlib.contextmanager
    def _routed_experts_with_grad(self):
        """The MoE layers on their training path while gradients are enabled (see the module notes)."""
        layers = [m for m in self._moe if not m.training] if torch.is_grad_enabled() else []
        for m in layers:
            m.training = True
        try:
            yield
        finally:
            for m in layers:
                m.training = False

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        b, c, h, w = x.shape
        if h != w:
            raise ValueError(f"HiDreamAdapter: latents {h} x {w}; only square images are sampled here")
        dtype, device = self.transformer.dtype, x.device
        t5, llama = self.split(embeds.tokens.to(device))
        # the scheduler's timesteps, sigma x num_train_timesteps in float32
        timesteps = sigma.to(device=device, dtype=torch.float32) * float(self.scheduler_config["num_train_timesteps"])
        with self._routed_experts_with_grad():
            out = self.transformer(hidden_states=x.to(dtype), timesteps=timesteps, encoder_hidden_states_t5=t5.to(dtype),
                                   encoder_hidden_states_llama3=llama.to(dtype),
                                   pooled_embeds=embeds.pooled.to(device, dtype), return_dict=False)[0]
        # train(): [B, C, S, p * p] patches (by the flag its unpatchify reads: the shapes coincide at h = p * p)
        if self.transformer.training and not self.transformer.config.force_inference_output:
            p = self.transformer.config.patch_size
            out = out.reshape(b, c, h // p, w // p, p, p).permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
        return -out.float()  # the pipeline's noise_pred = -output


class HiDreamPromptEncoder(PipelinePromptEncoder):
    """``HiDreamImagePipeline.encode_prompt`` (no CFG): ``encode(prompts) -> PromptEmbeds(tokens [B, L_t5 +
    n * L_llama, D], pooled [B, P])`` float32 on the CPU, the T5 states then every Llama layer's states
    (``n`` = its hidden layers, each ``max_sequence_length`` tokens), zero-padded to the wider width D.
    ``encode([""])`` is the pipeline's empty negative prompt."""

    name = "hidream"

    def __init__(self, pipe, path: Path, max_sequence_length: int, dtype: str, device: str):
        super().__init__(pipe, "hidream", path, max_sequence_length, dtype, device)
        self.t5_dim = int(pipe.text_encoder_3.config.d_model)
        self.llama_dim = int(pipe.text_encoder_4.config.hidden_size)
        self.dim = max(self.t5_dim, self.llama_dim)
        self.pooled_dim = int(pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim)

    def encode_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        t5, _, llama, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                                             do_classifier_free_guidance=False,
                                                             max_sequence_length=self.max_sequence_length)
        b = t5.shape[0]
        llama = llama.transpose(0, 1).reshape(b, -1, llama.shape[-1])  # [n, B, L, D] -> [B, n * L, D]
        tokens = t5.new_zeros(b, t5.shape[1] + llama.shape[1], self.dim)
        tokens[:, :t5.shape[1], :self.t5_dim] = t5
        tokens[:, t5.shape[1]:, :self.llama_dim] = llama.to(t5.dtype)
        return tokens, pooled


def load(path: str | Path, device: str = "cpu", options: dict | None = None):
    """Load a ``HiDreamImagePipeline`` folder: ``(HiDreamAdapter, HiDreamPromptEncoder, VAECodec, meta)``.

    ``options``: ``image_size`` (square pixels; default the pipeline's ``default_sample_size *
    vae_scale_factor``, the only size it renders; a multiple of vae_scale_factor x the patch size),
    ``guidance_scale`` (5.0), ``num_inference_steps`` (50), ``max_sequence_length`` (T5 and Llama tokens,
    128), ``dtype`` ("float32", "bfloat16", "float16"; the transformer and text encoders, the VAE stays
    float32). Raises ``ValueError`` naming the key for an unknown option, a bad size or dtype, or an
    unsupported scheduler."""
    from diffusers import AutoencoderKL, HiDreamImagePipeline

    path = Path(path)
    options, dtype = checked_options(options, OPTIONS, DTYPES, "HiDream")
    defaults = call_defaults(HiDreamImagePipeline, "num_inference_steps", "guidance_scale", "max_sequence_length")
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", dtype=torch.float32)
    pipe = HiDreamImagePipeline.from_pretrained(str(path), vae=vae, dtype=DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer.eval()
    size = check_image_size(int(options.get("image_size") or pipe.default_sample_size * pipe.vae_scale_factor),
                            pipe.vae_scale_factor * transformer.config.patch_size)
    hidream_sigmas(type(pipe.scheduler), dict(pipe.scheduler.config), transformer.max_seq, 1)  # refuses early
    text_pipe = HiDreamImagePipeline(
        scheduler=pipe.scheduler, vae=None, transformer=None,
        **{f"{k}{s}": getattr(pipe, f"{k}{s}") for k in ("text_encoder", "tokenizer") for s in ("", "_2", "_3", "_4")})
    for i in ("", "_2", "_3", "_4"):
        getattr(text_pipe, f"text_encoder{i}").eval().requires_grad_(False)
    length = int(options.get("max_sequence_length", defaults["max_sequence_length"]))
    encoder = HiDreamPromptEncoder(text_pipe, path, length, dtype, device)
    model = HiDreamAdapter(transformer, pipe.scheduler, min(length, pipe.tokenizer_3.model_max_length), encoder.t5_dim,
                           encoder.llama_dim, pipe.text_encoder_4.config.num_hidden_layers)
    meta = family_meta("hidream", PIPELINE, COMPONENT, path, size, options, defaults)
    return model, encoder, VAECodec(pipe.vae), meta
