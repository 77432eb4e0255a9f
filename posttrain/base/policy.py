"""The trainable policy and its reference: LoRA via peft (reference = adapters disabled, no copy) or
full fine-tuning (reference = a frozen copy)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch



@dataclass
class PolicyConfig:
    """``lora_rank`` > 0: LoRA (Hu et al. 2021) of that rank with ``lora_alpha`` on ``target_modules``
    (peft, ``init_lora_weights`` "gaussian" as Flow-GRPO: B = 0 so the policy starts equal to the
    reference). ``target_modules``: None = the adapter's ``lora_targets`` (its family's attention
projections). ``lora_rank`` = 0: full fine-tuning with a frozen copy as reference."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    init_lora_weights: str = "gaussian"
    target_modules: list[str] | None = None


class Policy:
    """Wraps a :class:`pretrain.backbone.Backbone` ``model`` whose ``.transformer`` is a diffusers model."""

    def __init__(self, model: torch.nn.Module, cfg: PolicyConfig, reference: bool = True):
        self.model, self.cfg = model, cfg
        self.lora = cfg.lora_rank > 0
        if self.lora:
            from peft import LoraConfig

            model.requires_grad_(False)
            init = True if cfg.init_lora_weights == "default" else cfg.init_lora_weights
            model.transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                     init_lora_weights=init,
                                                     target_modules=list(cfg.target_modules or model.lora_targets)))
            self.frozen_reference = None
        else:
            # reference=False: no frozen copy (an inference copy such as a rollout worker's needs none)
            self.frozen_reference = copy.deepcopy(model).requires_grad_(False).eval() if reference else None
            model.requires_grad_(True)
        self._merged: MergedCopy | None = None

    def lora_modules(self) -> int:
        """How many modules of the model peft wrapped with a LoRA layer (0 for full fine-tuning): a
        rollout worker's count must equal its trainer's, and be above zero, for it to sample the adapter."""
        from peft.tuners.lora import LoraLayer

        return sum(isinstance(m, LoraLayer) for m in self.model.modules()) if self.lora else 0

    def shape(self) -> dict:
        """The settings a resumed run must share with its checkpoint (``{dotted config key: value}``):
        the adapter's rank, alpha and targets set what the trained weights mean."""
        c = self.cfg
        return {"policy.lora_rank": c.lora_rank, "policy.lora_alpha": c.lora_alpha,
                "policy.target_modules": None if c.target_modules is None else list(c.target_modules)}

    def inference_model(self, version: int) -> torch.nn.Module:
        """The policy's function for no-grad forwards (rollout, the detached CFG branch): with LoRA, a
        plain copy whose targeted weights are W + scale * B A (no adapter matmuls), refreshed whenever
        ``version`` (the optimizer step) changes; the model itself for full fine-tuning. Outputs equal
        the policy's up to float rounding."""
        if not self.lora:
            return self.model
        if self._merged is None:
            self._merged = MergedCopy(self.model)
        return self._merged.refresh(version)

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
        """Write the LoRA adapter to ``out_dir`` (:func:`pretrain.models.pipelines.save_lora`: keys prefixed
        ``transformer.``, alpha in the metadata; loads with ``transformer.load_lora_adapter(out_dir)``);
        returns ``out_dir``, or None for full fine-tuning."""
        if not self.lora:
            return None
        from pretrain.models.pipelines import save_lora

        return save_lora((source or self.model).transformer, out_dir)


class MergedCopy:
    """A LoRA-free copy of a peft-LoRA ``model`` (a :class:`pretrain.backbone.Backbone`: a module with ``.transformer``)
    whose targeted linear weights are kept equal to base + the active adapters' delta weights."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora import LoraLayer

        t = copy.deepcopy(model.transformer)
        t.fuse_lora()
        t.unload_lora()
        self.model = model.with_transformer(t).requires_grad_(False).eval()
        self.pairs = [(m, t.get_submodule(name)) for name, m in model.transformer.named_modules()
                      if isinstance(m, LoraLayer)]
        self.version: int | None = None

    @torch.no_grad()
    def refresh(self, version: int) -> torch.nn.Module:
        """Recompute the merged weights unless already at ``version``; returns the copy."""
        if version != self.version:
            for lora, target in self.pairs:
                w = lora.get_base_layer().weight
                delta = sum(lora.get_delta_weight(a) for a in lora.active_adapters if a in lora.lora_A)
                target.weight.copy_(w + delta)
            self.version = version
        return self.model
