"""Speed options of the post-training loops. None changes the algorithm: the loss and the gradients
are the same up to float rounding (tests/integration/test_perf.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PerfConfig:
    """``merge_lora``: no-grad forwards (the rollout, the detached unconditional CFG branch in training)
    run on a copy of the policy with LoRA merged into its weights, W + scale * B A, refreshed after every
    optimizer step: no adapter matmuls where no gradient is needed (fp32 runs only: under bf16/fp16
    autocast the merged weights round differently from base + adapter and the first ratio would
    drift from 1, so it is ignored there). ``uncond_in_batch``: run the detached
    unconditional branch inside the conditional forward as one 2B batch with a graph (flow_grpo's layout:
    the same gradient, a backward over both halves; off by default, kept as the baseline).
    ``compile``: ``torch.compile`` each transformer block (policy, merged copy; first iterations are
    slower while it compiles). ``reward_workers``: threads scoring rewards while the next rollout batch
    is sampled (0 = score after the whole rollout)."""

    merge_lora: bool = True
    uncond_in_batch: bool = False
    compile: bool = False
    reward_workers: int = 1

    def validate(self, prefix: str = "") -> None:
        if self.reward_workers < 0:
            raise ValueError(f"{prefix}reward_workers: must be >= 0, got {self.reward_workers}")


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` every block of ``model.transformer.transformer_blocks`` in place (torchtitan's
    per-block compile: one graph reused by all blocks of the same shape); returns ``model``."""
    for block in model.transformer.transformer_blocks:
        block.compile()
    return model
