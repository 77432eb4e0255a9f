"""The benchmark's FLOP accounting: CPU attention counted by the closed form, the kernel floor's sum."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.kernel_rates import CPU_ATTENTION_FORMULAS, kernel_floor_seconds


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


def test_kernel_floor_is_flops_over_each_kernels_rate():
    counts = {"mm": 2e9, "addmm": 1e9, "_scaled_dot_product_flash_attention_for_cpu": 1e9,
              "_scaled_dot_product_flash_attention_for_cpu_backward": 3e9, "convolution": 4e9}
    # GEMMs 3e9 / 100e9 + attention 1e9 / 50e9 + 3e9 / 30e9 + others 4e9 / 200e9
    assert kernel_floor_seconds(counts, 100.0, (50.0, 30.0), 200.0) == pytest.approx(0.03 + 0.02 + 0.1 + 0.02)
