"""``grpo.old_log_prob: recompute``: the first ratio is 1 whatever batch size and precision the rollout
ran with (rollout batches of 16 against training mini-batches of 4; bf16 throughout, or a bf16 rollout
for an fp32 update), and what it costs."""

import pytest

from posttrain.grpo.stage import GRPORun
from tests.conftest import grpo_config

pytestmark = pytest.mark.core


def _first_iteration(export, run_dir, old_log_prob, precision="bf16"):
    run = GRPORun(grpo_config(run_dir, export, f"train.precision={precision}", "rollout.precision=bf16",
                              "rollout.batch_size=16",
                              "train.batch_size=4", "train.grad_accum=4", "perf.reuse_rollout_uncond=false",
                              f"grpo.old_log_prob={old_log_prob}"))
    return run.train_step()  # 4 mini-batches, one optimizer step at the end: every ratio is a first one


@pytest.mark.parametrize("train_precision", ["bf16", "fp32"])
def test_recomputed_old_log_probs_make_the_first_ratio_one(tiny_export, tmp_path, capsys, train_precision):
    rollout = _first_iteration(tiny_export, tmp_path / "rollout", "rollout", train_precision)
    recompute = _first_iteration(tiny_export, tmp_path / "recompute", "recompute", train_precision)
    drift = max(abs(rollout["ratio_max"] - 1), abs(rollout["ratio_min"] - 1))
    assert recompute["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert recompute["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert "time_old_log_prob_s" not in rollout and recompute["time_old_log_prob_s"] > 0
    if train_precision == "fp32":  # a bf16 rollout's log-probs are not the fp32 update's
        assert drift > 1e-4
    with capsys.disabled():
        print(f"\nbf16 rollout, {train_precision} update, rollout batch 16 / train mini-batch 4: first |ratio - 1| {drift:.2e} with the rollout's "
              f"log-probs, {max(abs(recompute['ratio_max'] - 1), abs(recompute['ratio_min'] - 1)):.2e} recomputed; "
              f"recompute {recompute['time_old_log_prob_s']:.3f} s = "
              f"{recompute['time_old_log_prob_s'] / recompute['time_train_s']:.2f} x the update's "
              f"{recompute['time_train_s']:.3f} s")
