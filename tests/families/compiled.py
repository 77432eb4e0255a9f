"""The ``gpu`` perf preset's model rewrites on a real family: every block compiled and its tanh GELUs
computed as ``x * sigmoid(2z)`` (:func:`posttrain.grpo.perf.apply_model_options`,
:func:`posttrain.grpo.perf.compile_blocks`) give the eager model's training log-probs and LoRA gradients."""

from __future__ import annotations

import torch


def _log_probs_and_grads(model: torch.nn.Module, traj, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training log-probs ``[B, steps]`` of ``traj``'s transitions under ``model`` and the gradients of their
    sum with respect to its trainable (LoRA) parameters."""
    from rollout.sampler import log_prob

    model.zero_grad(set_to_none=True)
    lp = torch.stack([log_prob(model, traj, t).log_prob for t in range(steps)], dim=1)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def compiled_vs_eager(model: torch.nn.Module, traj, steps: int) -> tuple[float, float, int]:
    """Eager, then with the ``gpu`` preset's rewrites applied to ``model`` in place (fp32, one process):
    returns (largest |log-prob difference| relative to the largest |log-prob|, largest |gradient
    difference| relative to the largest |gradient|, number of compiled blocks). ``model``: a
    :class:`pretrain.backbone.Backbone` with LoRA, in train mode; ``traj``: a rollout's trajectory batch."""
    from posttrain.grpo.perf import PerfConfig, apply_model_options, compile_blocks, resolve_perf

    eager_lp, eager = _log_probs_and_grads(model, traj, steps)
    perf = resolve_perf(PerfConfig(preset="gpu"), "fp32", distributed=False)
    assert perf.compile and perf.sigmoid_gelu
    apply_model_options(perf, model)
    assert any(type(m).__name__ == "SigmoidGELU" for m in model.modules())  # the family's tanh GELUs, rewritten
    compile_blocks(model)
    compiled = sum(b._compiled_call_impl is not None for b in model.blocks())
    lp, grads = _log_probs_and_grads(model, traj, steps)
    assert eager and grads.keys() == eager.keys()
    lp_err = ((lp - eager_lp).abs().max() / eager_lp.abs().max()).item()
    scale = max(g.abs().max() for g in eager.values())
    grad_err = (max((grads[n] - eager[n]).abs().max() for n in eager) / scale).item()
    return lp_err, grad_err, compiled


def assert_compiled_matches_eager(model: torch.nn.Module, traj, steps: int, family: str, blocks: int, capsys,
                                  tol: float = 1e-5) -> None:
    """:func:`compiled_vs_eager`, printed under ``family``'s name; asserts all ``blocks`` blocks compiled and
    both relative differences within ``tol`` (float32 rounding)."""
    lp_err, grad_err, compiled = compiled_vs_eager(model, traj, steps)
    with capsys.disabled():
        print(f"\n{family} gpu preset (compiled blocks, sigmoid GELU) vs eager: log-probs {lp_err:.1e}, LoRA "
              f"gradients {grad_err:.1e} (relative)")
    assert compiled == len(model.blocks()) == blocks
    assert lp_err <= tol and grad_err <= tol, (lp_err, grad_err)
