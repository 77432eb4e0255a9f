"""The benchmark's FLOP accounting: CPU attention counted by the closed form, the kernel floor's sum."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.kernel_rates import CPU_ATTENTION_FORMULAS, floor_by_class

pytestmark = pytest.mark.core


def _attention_counts(mapping):
    q = torch.randn(2, 3, 17, 8, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    return {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts().get("Global", {}).items()}


def test_cpu_attention_flops_are_the_closed_form():
    forward = 4 * 2 * 3 * 17 * 17 * 8  # Q K^T and P V: 2 matmuls of 2 * S * S * D per head
    counts = _attention_counts(CPU_ATTENTION_FORMULAS)
    assert counts["_scaled_dot_product_flash_attention_for_cpu"] == forward
    assert counts["_scaled_dot_product_flash_attention_for_cpu_backward"] == 5 * forward // 2  # 5 matmuls
    assert sum(_attention_counts({}).values()) == 0  # what the counter alone reports for this kernel


def test_kernel_floor_is_flops_over_each_kernels_rate_per_class():
    counts = {"mm": 2e9, "addmm": 1e9, "_scaled_dot_product_flash_attention_for_cpu": 1e9,
              "_scaled_dot_product_flash_attention_for_cpu_backward": 3e9, "convolution": 4e9}
    # GEMMs 3e9 / 100e9, attention 1e9 / 50e9 and 3e9 / 30e9, others 4e9 / 200e9
    floors = floor_by_class(counts, 100.0, (50.0, 30.0), 200.0)
    assert floors == pytest.approx({"GEMM": 0.03, "attention forward": 0.02, "attention backward": 0.1,
                                    "convolution": 0.02})


def test_kernel_classes_of_counter_and_profiler_names():
    from benchmarks.kernel_rates import kernel_class

    assert kernel_class("mm") == kernel_class("aten::addmm") == "GEMM"
    assert kernel_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention forward"
    assert kernel_class("_scaled_dot_product_flash_attention_for_cpu_backward") == "attention backward"
    assert kernel_class("aten::mkldnn_convolution") == kernel_class("convolution_backward") == "convolution"
    # an inductor kernel is elementwise work even when its name lists the extern ops around it
    assert kernel_class("graph_2_cpp_fused_convolution_native_group_norm_silu_3") == "fused elementwise (compiled)"
    assert kernel_class("aten::copy_") == "eager ATen ops"
    assert kernel_class("autograd::engine::evaluate_function: MmBackward0") == "framework"
    assert kernel_class("TorchDynamo Cache Lookup") == "framework"


def test_profiled_breakdown_accounts_for_the_wall_time():
    """The breakdown's wall time and its GEMM time agree with clocks read outside the profiler: a wall
    time taken at the wrong place, self times in the wrong unit or matmuls filed under another class fail."""
    import time

    from benchmarks.time_breakdown import CLASSES, OUTSIDE, breakdown_of_events, profiled_breakdown

    a, q = torch.randn(256, 256), torch.randn(1, 2, 64, 16)

    def gemms():
        for _ in range(20):
            a @ a

    def step():
        gemms()
        F.scaled_dot_product_attention(q, q, q)

    def seconds(fn):  # best of 5, no profiler
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    step()  # warm-up
    t0 = time.perf_counter()
    b = profiled_breakdown(step)
    outer = time.perf_counter() - t0
    assert b["GEMM"] > b["attention forward"] > 0 and b["attention backward"] == 0
    ops = sum(b[c] for c in CLASSES if c != OUTSIDE)  # self times: nested ops are not counted twice
    assert 0 < ops <= b["wall"] <= outer  # the step's wall time lies inside the whole call's
    assert b["wall"] >= 0.2 * seconds(step)  # and is the step's, not a fraction of it
    assert 0.2 * seconds(gemms) <= b["GEMM"] <= 10 * seconds(gemms)  # microseconds read as seconds fail
    synthetic = breakdown_of_events([("aten::mm", 2e6), ("graph_0_cpp_fused_add_0", 5e5), ("aten::add", 2.5e5),
                                     ("CompiledFunction", 2.5e5)], wall=4.0)
    assert synthetic == pytest.approx({**dict.fromkeys(CLASSES, 0.0), "GEMM": 2.0, "fused elementwise (compiled)": 0.5,
                                       "eager ATen ops": 0.25, "framework": 0.25, OUTSIDE: 1.0, "wall": 4.0})
