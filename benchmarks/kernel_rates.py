"""This machine's kernel rates at the benchmark model's shapes, the FLOP counter's missing CPU attention
formulas, and the time floor those rates put under an iteration.

``torch.utils.flop_counter`` has formulas for the CUDA attention kernels but not for
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), the kernel that
``F.scaled_dot_product_attention`` runs on CPU: without :data:`CPU_ATTENTION_FORMULAS` an iteration's
count leaves attention out (about a third of this model's work at 461 tokens, head dim 32).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

aten = torch.ops.aten


def _sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode(custom_mapping=...): shapes in, FLOPs out (the counter's own SDPA formulas).
CPU_ATTENTION_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}
ATTENTION_OPS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm"}
CONV_OPS = {"convolution", "convolution_backward", "mkldnn_convolution", "_convolution", "cudnn_convolution",
            "_slow_conv2d_forward", "_slow_conv2d_backward"}


def is_attention(op: str) -> bool:
    """Whether ``op`` (``aten.X`` without the prefix) is an attention kernel, forward or backward."""
    return op.removesuffix("_backward") in ATTENTION_OPS


def timed_rate(fn: Callable[[], object], flops: float, device: torch.device, seconds: float = 1.0) -> float:
    """GFLOP/s of ``fn`` doing ``flops`` (median of timed repeats for about ``seconds``, after 3 warm-ups)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times) / 1e9


def matmul_gflops(m: int, k: int, n: int, device: torch.device, seconds: float = 1.0) -> float:
    """fp32 ``[m, k] @ [k, n]`` rate in GFLOP/s."""
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    return timed_rate(lambda: a @ b, 2 * m * k * n, device, seconds)


def model_shape_gflops(device: torch.device, tokens: int = 8 * 256) -> float:
    """Aggregate fp32 rate over the transformer's GEMMs: a rollout batch of 8 x 256 image tokens against
    hidden 128 (attention projections, LoRA r 32) and the 4x MLP."""
    shapes = [(tokens, 128, 128), (tokens, 128, 512), (tokens, 512, 128), (tokens, 128, 32), (tokens, 32, 128)]
    flops = [2 * m * k * n for m, k, n in shapes]
    secs = [f / (matmul_gflops(*s, device, 0.3) * 1e9) for f, s in zip(flops, shapes)]
    return sum(flops) / sum(secs) / 1e9


def attention_gflops(device: torch.device, batch: int = 16, heads: int = 4, tokens: int = 461,
                     head_dim: int = 32) -> tuple[float, float]:
    """fp32 ``F.scaled_dot_product_attention`` rates (forward, backward) in GFLOP/s at the benchmark
    model's joint attention: a CFG batch of 2 x 8, 4 heads x 32, 256 image + 205 text tokens."""
    q = torch.randn(batch, heads, tokens, head_dim, device=device, requires_grad=True)
    shape = tuple(q.shape)
    fwd_flops = flop_counter.sdpa_flop_count(shape, shape, shape)
    bwd_flops = flop_counter.sdpa_backward_flop_count(shape, shape, shape, shape)
    with torch.no_grad():
        fwd = timed_rate(lambda: F.scaled_dot_product_attention(q, q, q), fwd_flops, device, 0.5)
    both = timed_rate(lambda: F.scaled_dot_product_attention(q, q, q).sum().backward(), fwd_flops + bwd_flops,
                      device, 0.5)
    bwd_seconds = (fwd_flops + bwd_flops) / (both * 1e9) - fwd_flops / (fwd * 1e9)
    return fwd, bwd_flops / max(bwd_seconds, 1e-12) / 1e9


FLOOR_CLASSES = ("attention forward", "attention backward", "GEMM", "convolution")


def kernel_class(name: str) -> str:
    """The class of a kernel, from a FLOP counter's op name (``mm``) or a profiler event's name
    (``aten::mm``, inductor's ``graph_3_cpp_fused_...``): one of :data:`FLOOR_CLASSES` (the counted
    kernels), ``"fused elementwise (compiled)"``, ``"eager ATen ops"`` or ``"framework"`` (any other
    event: autograd engine, dynamo, compiled-graph calls, the optimizer's step)."""
    if name.startswith("graph_") and "_cpp_fused_" in name:  # before the ATen names it may contain
        return "fused elementwise (compiled)"
    op = name.removeprefix("aten::")
    if is_attention(op):
        return "attention backward" if op.endswith("_backward") else "attention forward"
    if op in GEMM_OPS:
        return "GEMM"
    if op in CONV_OPS:
        return "convolution"
    if name.startswith("aten::"):
        return "eager ATen ops"
    return "framework"


def floor_by_class(counts: dict[str, int], gemm_rate: float, attention_rates: tuple[float, float],
                   other_rate: float) -> dict[str, float]:
    """Seconds an iteration's counted work needs at this machine's measured rates, per class of
    :data:`FLOOR_CLASSES`: GEMMs at the model-shape rate, attention forward / backward at theirs, other
    counted ops at ``other_rate``, under ``"convolution"`` (the counter's only other counted kernels).
    Elementwise work, which the counter does not count, is left out, so the real floor is higher.
    ``counts``: op name (``aten.X`` without the prefix) -> FLOPs; rates in GFLOP/s."""
    out = dict.fromkeys(FLOOR_CLASSES, 0.0)
    for op, flops in counts.items():
        cls = kernel_class(op)
        rate = {"GEMM": gemm_rate, "attention forward": attention_rates[0],
                "attention backward": attention_rates[1]}.get(cls, other_rate)
        out[cls if cls in out else "convolution"] += flops / (rate * 1e9)
    return out

