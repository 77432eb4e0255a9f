"""Low-precision training of the denoiser's Linear layers with torchao's converters (the path torchtitan
uses): FP8 with row-wise or tensor-wise scales (H100 / H200 and newer), MXFP8 and NVFP4 (Blackwell), or
torchao's emulation of them on any device (CPU included) for tests and debugging.

``train.low_precision`` (:class:`LowPrecisionConfig`) picks the recipe. The master weights, the
optimizer state, LoRA adapters, and every log-prob and loss stay in their own dtype (float32 unless
``parallel.param_dtype`` says otherwise); only the matmuls of the converted layers run in the low-precision
format, with scales computed on the fly (dynamic scaling). Layers where precision matters and compute
does not stay unconverted (:data:`DIT_KEEP`, the config's ``keep`` list): the timestep and text embedders,
the adaLN modulation projections, the final layer, LoRA adapters, and any Linear whose dimensions are
not multiples of what the recipe's kernels need (:data:`MULTIPLE`).

Recipes (torchao 0.18): ``fp8_rowwise`` (``torchao.float8``: e4m3 throughout, power-of-two scales per row)
and ``fp8_tensorwise`` (e4m3 forward, e5m2 gradients, one scale per tensor), ``mxfp8`` (e4m3 in all three GEMMs in blocks of 32 with
power-of-two scales, OCP Microscaling spec v1.0; torchao's MXFP8 matmul called from the Linear's
forward, the parameters staying plain tensors), ``nvfp4`` (``NVFP4TrainingConfig``: e2m1 in blocks of
16 with e4m3 block scales, a random Hadamard transform and stochastic rounding of gradients; Triton
kernels, no emulation in torchao). ``fp8_all_gather`` (tensor-wise only) makes FSDP2 all-gather the
weights in FP8; their scales (the amax of each full weight) are then precomputed once after each
optimizer step, one all-reduce for all layers instead of one per layer (:func:`after_optimizer_step`).
"""

from __future__ import annotations

import fnmatch
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: loading a config does not import it
    import torch

log = logging.getLogger(__name__)

RECIPES = ("none", "fp8_rowwise", "fp8_tensorwise", "mxfp8", "nvfp4")
# dimensions a converted Linear's in and out features must be multiples of (the kernels' tile / block sizes)
MULTIPLE = {"fp8_rowwise": 16, "fp8_tensorwise": 16, "mxfp8": 32, "nvfp4": 128}
# CUDA compute capability each recipe's kernels need without emulation
CAPABILITY = {"fp8_rowwise": (8, 9), "fp8_tensorwise": (8, 9), "mxfp8": (10, 0), "nvfp4": (10, 0)}
DIT_KEEP = (
    "time_text_embed.*",  # SD3 / FLUX: the timestep (and guidance) and pooled-text embedders
    "context_embedder",  # SD3 / FLUX: the text-token projection
    "condition_embedder.*",  # Wan: timestep and text embedders
    "time_embedding.*", "add_embedding.*",  # UNet: timestep and added-condition embedders
    "*norm*.linear",  # adaLN modulation: norm1, norm1_context, FLUX single blocks' norm, norm_out
    "proj_out",  # the final projection (the top-level one; FLUX single blocks' proj_out is converted)
    "*.lora_A.*", "*.lora_B.*",  # LoRA adapters stay in their own dtype (float32)
)


@dataclass
class LowPrecisionConfig:
    """``recipe``: one of :data:`RECIPES` ("none": off). ``emulate``: run torchao's emulation of the recipe
    (any device; FP8 casts and scales exact, the matmul in high precision), required without a GPU of the
    recipe's compute capability (8.9 for FP8, 10.0 for MXFP8 / NVFP4). ``fp8_all_gather``: FSDP2
    all-gathers converted weights in FP8 (``fp8_tensorwise`` only). ``keep``: fnmatch patterns of module
    names inside the denoiser (``transformer_blocks.0.attn.to_q``) left unconverted."""

    recipe: str = "none"
    emulate: bool = False
    fp8_all_gather: bool = False
    keep: list[str] = field(default_factory=lambda: list(DIT_KEEP))

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def validate(self, prefix: str = "") -> None:
        """``ValueError`` naming the key for an unknown recipe, FP8 all-gather without tensor-wise scales,
        or NVFP4 emulation (torchao has none)."""
        if self.recipe not in RECIPES:
            raise ValueError(f"{prefix}recipe: '{self.recipe}' is not one of {', '.join(RECIPES)}")
        if self.fp8_all_gather and self.recipe != "fp8_tensorwise":
            raise ValueError(f"{prefix}fp8_all_gather: needs recipe fp8_tensorwise (one scale per tensor can be "
                             f"all-gathered with the FP8 shards), got recipe {self.recipe}")
        if self.recipe == "nvfp4" and self.emulate:
            raise ValueError(f"{prefix}emulate: torchao has no emulation of NVFP4 training (its kernels are "
                             f"Triton on Blackwell GPUs); use mxfp8 or fp8_* with emulate=true off Blackwell")

    def check_device(self, prefix: str, device: str) -> None:
        """``ValueError`` naming ``<prefix>recipe`` when the training ``device`` ("auto", "cpu", "cuda[:i]")
        cannot run the recipe unemulated (no CUDA device, or a lower compute capability than
        :data:`CAPABILITY`)."""
        if not self.enabled or self.emulate:
            return
        need, have = CAPABILITY[self.recipe], device_capability(device)
        if have is None or have < need:
            where = "this machine has no CUDA device" if have is None else f"the GPU has capability {have}"
            raise ValueError(f"{prefix}recipe: {self.recipe} needs an NVIDIA GPU of compute capability "
                             f"{need[0]}.{need[1]}+ and {where}; set {prefix}emulate=true to emulate it")


def device_capability(device: str = "auto") -> tuple[int, int] | None:
    """The CUDA compute capability the training ``device`` ("auto", "cpu", "cuda[:i]") would use, or None
    when it is not a CUDA device."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    index = int(device.split(":")[1]) if device.startswith("cuda:") else None
    return tuple(torch.cuda.get_device_capability(index))


def plan(denoiser: torch.nn.Module, cfg: LowPrecisionConfig) -> tuple[list[str], dict[str, str]]:
    """``(names of the Linear layers to convert, {kept Linear name: why})`` for ``denoiser`` (the diffusers
    model; names relative to it). A layer is kept when a ``cfg.keep`` pattern matches its name or when its
    in / out features are not multiples of the recipe's :data:`MULTIPLE`."""
    import torch

    convert, kept = [], {}
    multiple = MULTIPLE.get(cfg.recipe, 1)
    for name, mod in denoiser.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        pattern = next((p for p in cfg.keep if fnmatch.fnmatchcase(name, p)), None)
        if pattern is not None:
            kept[name] = f"matches keep pattern '{pattern}'"
        elif mod.in_features % multiple or mod.out_features % multiple:
            kept[name] = f"features {mod.in_features} -> {mod.out_features} not multiples of {multiple}"
        else:
            convert.append(name)
    return convert, kept


def convert(denoiser: torch.nn.Module, cfg: LowPrecisionConfig) -> list[str]:
    """Convert ``denoiser``'s Linear layers per ``cfg`` in place (before FSDP2, after LoRA adapters are
    added: a LoRA layer's frozen ``base_layer`` is converted, its adapters kept). Returns the converted
    names (``[]`` when the recipe is "none"). :class:`pretrain.extras.MissingExtra` without torchao."""
    if not cfg.enabled:
        return []
    import torch

    from pretrain.extras import require

    require("torchao", f"train.low_precision.recipe: {cfg.recipe}")
    names, kept = plan(denoiser, cfg)
    chosen = set(names)
    if cfg.recipe.startswith("fp8_"):
        from dataclasses import replace

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = replace(Float8LinearConfig.from_recipe_name(cfg.recipe.removeprefix("fp8_")), emulate=cfg.emulate,
                         enable_fsdp_float8_all_gather=cfg.fp8_all_gather)
        convert_to_float8_training(denoiser, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    elif cfg.recipe == "mxfp8":
        # torchao's MXFP8 matmul (its autograd function, as its MXFP8 training config uses it) called from the
        # Linear's own forward: the parameters stay plain tensors, so checkpoints, exports, FSDP2 and the
        # optimizer see ordinary weights, and the bias is added where autograd sees it (torchao 0.18's
        # parameter wrapper adds it untracked: the bias never gets a gradient)
        from torchao.quantization.quantize_.common import KernelPreference

        preference = KernelPreference.EMULATED if cfg.emulate else KernelPreference.AUTO
        for name in names:
            mod = denoiser.get_submodule(name)
            mod.__class__, mod.kernel_preference = _mxfp8_linear(), preference
    else:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
        from torchao.quantization import quantize_

        quantize_(denoiser, NVFP4TrainingConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn in chosen)
    denoiser._posttrain_fp8_precompute = cfg.fp8_all_gather
    log.info("train.low_precision: %s%s on %d Linear layers; %d kept in high precision", cfg.recipe,
             " (emulated)" if cfg.emulate else "", len(names), len(kept))
    return names


def _mxfp8_forward(self, x):
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    out = _to_mxfp8_then_scaled_mm(x, self.weight, self.kernel_preference, ScaleCalculationMode.RCEIL)
    return out if self.bias is None else out + self.bias.to(out.dtype)


_MXFP8_LINEAR: list = []


def _mxfp8_linear() -> type:
    """``MXFP8Linear``: an ``nn.Linear`` (same parameters, state-dict keys and init) whose matmul is
    torchao's MXFP8 one in all three GEMMs (e4m3 in blocks of 32, RCEIL power-of-two scales; its
    ``kernel_preference`` attribute picks emulation). Built on first use, so importing this module does
    not import torch."""
    if not _MXFP8_LINEAR:
        import torch

        _MXFP8_LINEAR.append(type("MXFP8Linear", (torch.nn.Linear,), {"forward": _mxfp8_forward}))
    return _MXFP8_LINEAR[0]


def fp8_all_gather_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoisers in ``model`` converted with ``fp8_all_gather`` (found once, when a runtime is built
    after the conversion; ``[]`` for every other model)."""
    return [m for m in model.modules() if getattr(m, "_posttrain_fp8_precompute", False)]


def after_optimizer_step(modules: list[torch.nn.Module]) -> None:
    """Precompute the FP8 scales FSDP2's FP8 all-gather uses, once per optimizer step, for ``modules``
    (:func:`fp8_all_gather_modules`; torchao's ``precompute_float8_dynamic_scale_for_fsdp``); a no-op for
    an empty list."""
    for mod in modules:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(mod)


def _high_precision(p: torch.Tensor) -> torch.Tensor | None:
    """The high-precision tensor torchao wrapped ``p``'s data in (MXFP8 / FP8 training weight wrappers keep
    it as ``_data``, the FP8 all-gather wrapper as ``_tensor``), or None for a plain tensor."""
    for attr in ("_data", "_tensor"):
        inner = getattr(p, attr, None)
        if inner is not None and type(inner) is not type(p):
            return inner
    return None


@contextmanager
def plain_weights(module: torch.nn.Module):
    """Within the block, every parameter of ``module`` that torchao wrapped is its plain high-precision
    tensor (same values, same ``requires_grad``), so ``save_pretrained`` and safetensors write ordinary
    weights; the wrapped parameters come back on exit. A no-op for unconverted models."""
    import torch

    swapped = []
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            inner = None if p is None else _high_precision(p)
            if inner is not None:
                swapped.append((mod, name, p))
                mod._parameters[name] = torch.nn.Parameter(inner, requires_grad=p.requires_grad)
    try:
        yield module
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p
