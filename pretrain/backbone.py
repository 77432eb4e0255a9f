"""The backbone interface every model adapter implements (one per model family, in
``pretrain/models/<family>/``).

An adapter is a ``torch.nn.Module`` whose ``forward(x, sigma, embeds)`` returns the flow-matching
velocity v = eps - x0 for the state x = (1 - sigma) x0 + sigma eps (float32, shape of ``x``), whatever
the wrapped model predicts (velocity, epsilon) and however it lays out its input (packed patches,
video latents). Everything downstream (ODE/SDE sampling, log-probs, GRPO, DPO) only sees this
interface, so a model family is one adapter file, never a copy of a trainer. Parallelism sees it through
two more methods: :meth:`Backbone.blocks` (the units FSDP2, activation checkpointing and per-block compile
wrap) and :meth:`Backbone.sequence_parallel` (the family's Ulysses plan), so ``pretrain.parallel``
imports no model code.
"""

from __future__ import annotations

import copy

import torch

from pretrain.flow import cfg_combine
from pretrain.schedule import sigma_schedule


class ConditioningError(ValueError):
    """The prompts' conditioning images do not fit the model: a family without the input given some, one
    that needs them given none, or images of the wrong batch, size or channels."""


def _refuse_images(module: "Backbone", args: tuple, kwargs: dict) -> None:
    """A forward pre-hook: :class:`ConditioningError` when the prompts carry conditioning images and the
    family (``module.takes_images`` False) has no input for them."""
    embeds = args[2] if len(args) > 2 else kwargs.get("embeds")
    if getattr(embeds, "images", None) is not None and not module.takes_images:
        raise ConditioningError(f"{type(module).__name__}: the prompts carry conditioning images (editing or "
                         f"image-to-video data) and this family has no conditioning-image input")


class Backbone(torch.nn.Module):
    """Base class of model adapters.

    ``transformer``: the diffusers denoiser (a transformer, or a UNet for the UNet family): LoRA,
    FSDP2, compile and exports act on it. Subclasses implement ``forward(x [B, ...], sigma [B] float
    in [0, 1], embeds: PromptEmbeds) -> velocity float32 [B, ...]`` and may override the hooks below.
    """

    #: LoRA target module names (peft ``target_modules``) used when the policy config names none.
    lora_targets: list[str] = []
    #: Attributes of the denoiser holding its repeated blocks, in forward order (a ``ModuleList`` or one
    #: module each), e.g. ``("transformer_blocks",)``: see :meth:`blocks_of`.
    block_attrs: tuple[str, ...] = ()

    #: Whether ``forward`` reads the prompts' conditioning images (``PromptEmbeds.images``); a family
    #: without that input refuses prompts that carry them instead of ignoring them.
    takes_images: bool = False

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.register_forward_pre_hook(_refuse_images, with_kwargs=True)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """The sampling schedule, float32 ``[num_inference_steps + 1]``, decreasing, last entry 0.
        Default: :func:`pretrain.schedule.sigma_schedule` with ``shift`` (None = 1). A family
        adapter returns its pipeline scheduler's sigmas, so our sampler walks the pipeline's steps."""
        return sigma_schedule(num_inference_steps, 1.0 if shift is None else shift)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep input the denoiser receives at ``sigma`` (float32, shape of ``sigma``), in the
        wrapped model's own convention (SD3 / Wan: sigma x 1000); recorded on rollouts. Default: sigma."""
        return sigma.float()

    def cfg_combine(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The guided velocity from the two CFG branches (float32 ``[B, ...]`` each), the rule this family's
        pipeline applies: :func:`pretrain.flow.cfg_combine` (Ho & Salimans 2022) by default."""
        return cfg_combine(v_cond, v_uncond, guidance_scale)

    def experts(self, sigma: torch.Tensor) -> torch.Tensor | None:
        """Which expert of a mixture-of-denoisers (Wan2.2 A14B) takes a step at each of ``sigma`` ``[T]``:
        long ``[T]``, recorded on rollouts and checked when their log-probs are recomputed; None (the
        default) for a single denoiser."""
        return None

    def moe_layers(self) -> list[torch.nn.Module]:
        """The denoiser's mixture-of-experts feed-forward layers in DeepSeek-V3's layout (``gate``,
        ``experts``, ``shared_experts``: :mod:`pretrain.parallel.expert`), which ``parallel.ep`` shards;
        empty (the default) for a dense denoiser."""
        return []

    def initial_scale(self, sigma0: float) -> float:
        """Factor turning unit Gaussian noise into the state at the schedule's first sigma
        ``sigma0``. 1 for flow models (they start from pure noise, sigma0 = 1)."""
        return 1.0

    def train_sigmas(self) -> torch.Tensor | None:
        """The flow sigmas of the denoiser's discrete training timesteps, float32 ``[T]`` (entry t: timestep
        t), which the ``epsilon`` pretraining objective draws from (:mod:`pretrain.objective`); None for a
        continuous-time model (default)."""
        return None

    def export_settings(self) -> dict:
        """What an export must record, besides the denoiser, to rebuild this adapter
        (:meth:`from_settings`; ``posttrain.json`` ``"adapter"``): a JSON-serialisable dict, empty by
        default (e.g. the UNet family's noise scheduler config)."""
        return {}

    @classmethod
    def from_settings(cls, transformer: torch.nn.Module, settings: dict) -> "Backbone":
        """The adapter around ``transformer`` with ``settings`` (what :meth:`export_settings` wrote).
        Default: ``cls(transformer)``; raises ``ValueError`` naming the keys if ``settings`` is not empty."""
        if settings:
            raise ValueError(f"{cls.__name__}: takes no adapter settings, got {sorted(settings)}")
        return cls(transformer)

    def with_transformer(self, transformer: torch.nn.Module) -> "Backbone":
        """A shallow copy of this adapter (same settings) around another denoiser, e.g. a LoRA-merged
        copy of its own. The module's own registries (submodules, parameters, hooks) are copied, not
        shared, so nothing registered on one reaches the other."""
        new = copy.copy(self)
        for k, v in self.__dict__.items():
            if k.startswith("_") and isinstance(v, dict):
                new.__dict__[k] = type(v)(v)
        new._modules["transformer"] = transformer
        return new

    @classmethod
    def blocks_of(cls, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated blocks of ``denoiser`` (a denoiser this adapter class wraps) found under
        :attr:`block_attrs`, in forward order. Raises ``ValueError`` naming both classes when there are
        none."""
        out: list[torch.nn.Module] = []
        for name in cls.block_attrs:
            found = getattr(denoiser, name, None)
            if isinstance(found, torch.nn.ModuleList):
                out += list(found)
            elif isinstance(found, torch.nn.Module):
                out.append(found)
        if not out:
            raise ValueError(f"{cls.__name__}: no blocks found in {type(denoiser).__name__} "
                             f"(looked for {cls.block_attrs})")
        return out

    def blocks(self) -> list[torch.nn.Module]:
        """The denoiser's repeated blocks in forward order: the units of FSDP2 sharding, activation
        checkpointing and per-block compile (:meth:`blocks_of` of ``self.transformer``). ``ValueError``
        naming the classes if there are none."""
        return self.blocks_of(self.transformer)

    def sequence_parallel(self, group) -> list:
        """Install this family's sequence-parallel plan on ``self.transformer`` for the process group
        ``group`` (its forward still takes and returns full tensors on every rank of the group); returns
        the hook handles (``.remove()`` each to undo; attention processors are restored by the caller,
        :func:`pretrain.parallel.sequence.enable_sequence_parallel`). The base class has no plan: raises
        ``ValueError`` naming the adapter class."""
        raise ValueError(f"sequence parallel: {type(self).__name__} has no sequence-parallel plan")

    tp_plan: dict[str, str] | None = None
    """This family's tensor-parallel plan (module-name pattern -> style, :mod:`pretrain.parallel.tensor`);
    None: the family has none."""

    tp_local_heads: bool = True
    """Under TP, set each attention module's ``heads`` to this rank's count (processors that reshape by
    ``attn.heads``, as SD3's, FLUX's and Wan's do). False for processors that derive ``head_dim`` from
    ``inner_dim / heads`` and let the head count follow the sharded width (Qwen-Image's): they need the
    global count."""

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        """The plan :func:`pretrain.parallel.tensor.apply_tensor_parallel` applies for TP degree ``tp``:
        :attr:`tp_plan`. Raises ``ValueError`` naming the adapter class when the family has no plan, or
        naming ``num_attention_heads`` when ``tp`` does not divide it."""
        if self.tp_plan is None:
            raise ValueError(f"tensor parallel: {type(self).__name__} has no tensor-parallel plan")
        heads = getattr(self.transformer.config, "num_attention_heads", None)
        if heads is not None and heads % tp:
            raise ValueError(f"tensor parallel: parallel.tp={tp} does not divide num_attention_heads={heads}")
        return self.tp_plan
