"""The one speed switch every post-training stage shares: ``perf.compile``, ``torch.compile`` per block.

GRPO's further speed options (merged LoRA, presets, transitions per forward, ...) live in its own
:class:`posttrain.grpo.perf.PerfConfig`; DPO and midtraining take only this block, so any other ``perf`` key
there is an unknown key (exit 2, naming it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.parallel.fsdp import apply_compile


@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` each transformer block of the policy (first steps are slower while it
    compiles; the numbers stay those of eager mode up to float rounding). None or false: eager."""

    compile: bool | None = None


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` every block of ``model`` (a :class:`pretrain.backbone.Backbone`; its ``blocks()``)
    in place (torchtitan's per-block compile); returns ``model``. GRPO calls a block in several guises (with and without
    gradients, adapters on and off, the merged copy, batch B and 2B), each a graph of its own, so the
    recompile limit is raised to keep them all compiled."""
    import torch._dynamo

    dyn = torch._dynamo.config
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dyn, key):
            setattr(dyn, key, max(getattr(dyn, key), 64))
    apply_compile(model)
    return model
