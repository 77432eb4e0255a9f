"""The trainable policy and its reference: LoRA via peft (reference = adapters disabled, no copy) or
full fine-tuning (reference = a frozen copy)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

SD3_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                 "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


@dataclass
class PolicyConfig:
    """``lora_rank`` > 0: LoRA (Hu et al. 2021) of that rank with ``lora_alpha`` on ``target_modules``
    (peft, ``init_lora_weights`` "gaussian" as Flow-GRPO: B = 0 so the policy starts equal to the
    reference). ``lora_rank`` = 0: full fine-tuning with a frozen copy as reference."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    init_lora_weights: str = "gaussian"
    target_modules: list[str] = field(default_factory=lambda: list(SD3_ATTENTION))


class Policy:
    """Wraps an ``SD3Adapter``-like ``model`` whose ``.transformer`` is a diffusers model."""

    def __init__(self, model: torch.nn.Module, cfg: PolicyConfig):
        self.model, self.cfg = model, cfg
        self.lora = cfg.lora_rank > 0
        if self.lora:
            from peft import LoraConfig

            model.requires_grad_(False)
            init = True if cfg.init_lora_weights == "default" else cfg.init_lora_weights
            model.transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                     init_lora_weights=init, target_modules=list(cfg.target_modules)))
            self.frozen_reference = None
        else:
            self.frozen_reference = copy.deepcopy(model).requires_grad_(False).eval()
            model.requires_grad_(True)

    @contextlib.contextmanager
    def reference(self):
        """Context yielding the reference model (adapters disabled for LoRA, the frozen copy otherwise)."""
        if not self.lora:
            yield self.frozen_reference
            return
        self.model.transformer.disable_adapters()
        try:
            yield self.model
        finally:
            self.model.transformer.enable_adapters()

    def merged_transformer(self, source: torch.nn.Module | None = None) -> torch.nn.Module:
        """A plain copy of the transformer of ``source`` (default: the policy) with LoRA fused in."""
        t = copy.deepcopy((source or self.model).transformer)
        if self.lora:
            t.fuse_lora()
            t.unload_lora()
        return t.requires_grad_(False)

    def save_adapter(self, out_dir: str | Path, source: torch.nn.Module | None = None) -> Path | None:
        """Write the LoRA adapter (diffusers/peft format, safetensors) to ``out_dir``; None for full FT."""
        if not self.lora:
            return None
        (source or self.model).transformer.save_lora_adapter(str(out_dir), safe_serialization=True)
        return Path(out_dir)
