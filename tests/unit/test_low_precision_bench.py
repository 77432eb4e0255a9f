"""The GPU benchmark of low-precision steps runs its code path on CPU at tiny size (emulated): every row
trains (finite, falling losses), counts its converted layers and reports FLOPs that match the formula."""

import pytest
from tests.conftest import require_extra

pytestmark = pytest.mark.core

require_extra("torchao", "lowp")


def test_the_low_precision_benchmark_runs_at_tiny_size(tmp_path):
    from benchmarks.low_precision_step import SHAPES, main

    rows = main(["--shape", "tiny", "--emulate", "--batch", "4", "--steps", "2", "--warmup", "1",
                 "--lr", "1e-3", "--recipes", "bf16,fp8_rowwise,mxfp8", "--json", str(tmp_path / "rows.json")])
    assert [r["recipe"] for r in rows] == ["bf16", "fp8_rowwise", "mxfp8"]
    assert rows[0]["converted_layers"] == 0 and rows[1]["converted_layers"] == rows[2]["converted_layers"] > 0
    config, side, text = SHAPES["tiny"]
    seq, width = (side // config["patch_size"]) ** 2 + text, config["num_attention_heads"] * config["attention_head_dim"]
    attention = config["num_layers"] * 4 * 4.0 * seq * seq * config["attention_head_dim"] * config["num_attention_heads"]
    # the Linear FLOPs include each block's q/k/v/out projections of both streams at least
    assert rows[0]["tflops_per_step"] * 1e12 > 3 * (attention + config["num_layers"] * 4 * 2 * 4 * seq * width * width)
    assert all(r["tflops_per_step"] == rows[0]["tflops_per_step"] for r in rows)  # the same work in each row
    assert all(r["losses"][-1] < r["losses"][0] for r in rows) and (tmp_path / "rows.json").is_file()
