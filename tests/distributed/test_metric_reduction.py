"""Metrics reduced right across ranks: with 2 gloo ranks holding 1 and 3 samples (an uneven split), the
logged means are the pooled means over the 4 samples (not the mean of the per-rank means) and the
maxima / minima the true ones (not averaged)."""

import pytest
import math

import torch

from posttrain.grpo.stage import RANK_SAME, summarize
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.job import JobRanks
from pretrain.parallel.launch import run_ranks

pytestmark = pytest.mark.core

SAMPLES = [[0.5], [4.0, -1.0, 2.5]]  # rank 0 holds 1 sample, rank 1 holds 3


def _logged(rank, world):
    ranks = JobRanks(ParallelDims().build_mesh("cpu"), torch.device("cpu"))
    mine = SAMPLES[rank]
    # one mini-batch's stats as the update reports them (per-sample means and extremes of this rank), and
    # a runtime value every rank agrees on
    stats = [{"kl": sum(mine) / len(mine), "ratio_max": max(mine), "ratio_min": min(mine), "grad_norm": 0.25,
              "lr": 1e-3, "nonfinite": ""}]
    return ranks.pool(summarize(stats), len(mine), RANK_SAME), ranks.mean([sum(mine) / len(mine)])[0]


def test_uneven_ranks_log_pooled_means_and_true_extremes():
    everything = [x for r in SAMPLES for x in r]
    results = run_ranks(_logged, world_size=2)
    for logged, mean_of_means in results:
        assert math.isclose(logged["kl"], sum(everything) / len(everything), rel_tol=1e-12)  # 1.5
        assert logged["ratio_max"] == 4.0 and logged["ratio_min"] == -1.0
        assert logged["grad_norm"] == 0.25 and logged["lr"] == 1e-3 and logged["nonfinite"] == ""
        assert mean_of_means == (0.5 + 5.5 / 3) / 2  # what a plain mean over ranks gives: 1.1667, not 1.5
