"""A LoRA policy that differs from its reference, for family tests of the ratio == 1 invariant."""

from __future__ import annotations

import torch


def perturbed_lora_policy(model: torch.nn.Module, rank: int = 4, alpha: float = 8.0, std: float = 0.05, seed: int = 0):
    """``posttrain.base.policy.Policy`` with LoRA (``rank``, ``alpha``) on ``model``'s default targets, its
    ``lora_B`` weights drawn from N(0, ``std``^2) (seeded by ``seed``) so the policy's velocity differs
    from the reference's (peft starts with B = 0). Returns the policy."""
    from posttrain.base.policy import Policy, PolicyConfig

    torch.manual_seed(seed)
    policy = Policy(model, PolicyConfig(lora_rank=rank, lora_alpha=alpha))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return policy
