"""The sweep's report and prepare steps stay true for short budgets and partial selections (no training:
probe rows are written by hand)."""

import pytest
import json

import numpy as np

from posttrain.tools.sweep import needed
from posttrain.tools.sweep_config import SweepConfig, run_dir_of
from posttrain.tools.sweep_report import collect, curve_grid, on_grid, write_report
from pretrain.config import load_config
from pretrain.runtime.metrics import MetricsLogger
from tests.conftest import ROOT

pytestmark = pytest.mark.core

SWEEP = ROOT / "configs/sweep/emoji_algorithms.yaml"


def test_prepare_runs_only_what_the_selected_tasks_use():
    cfg = load_config(SweepConfig, SWEEP, ["run_tasks=[jpeg]", "run_arms=[flow_grpo]"])
    made = {step.creates.split("/")[2] if "reward" in step.creates else "export": needed(cfg, step)
            for step in cfg.prepare}
    # jpeg is judged by learned_clip_b (its guard) and trains on JPEG: the A ensemble is not needed
    assert made == {"export": True, "learned_clip_b": True, "learned_clip_a": False, "learned_clip_a_seed2": False,
                    "learned_clip_a_seed3": False, "learned_clip_a_seed4": False, "learned_clip_a_seed5": False}
    full = load_config(SweepConfig, SWEEP, [])
    assert all(needed(full, step) for step in full.prepare)  # every task: every reward model


def _probe(iteration, train_s, reward):
    return {"iteration": iteration, "train_s": train_s, "samples": 64 * iteration, "reward": [reward, reward],
            "guard_loss": 0.5, "guard_reward": [0.1, 0.1]}


def test_report_header_and_curves_are_true_past_a_short_budget(tmp_path):
    cfg = load_config(SweepConfig, SWEEP, [f"run_dir={tmp_path}", "budget_s=20", "eval_every_s=10", "seeds=[0]"])
    for arm, (t_end, final) in {"flow_grpo": (82.0, -1.9345), "nft": (57.0, -1.5)}.items():
        out = run_dir_of(cfg, "jpeg", arm, 0)
        out.mkdir(parents=True)
        rows = [_probe(0, 0.0, -2.0), _probe(1, t_end, final)]
        (out / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(cfg).read_text()
    assert report.startswith("# Sweep: flow_grpo, nft\n")  # the arms that ran, not all nine
    assert "budget of 20 s" in report and "the runs trained 57-82 s" in report
    assert "| flow_grpo | 1 | 1 | 82.0 | 64 | -1.9345 (nan) |" in report  # 82 s for its one step
    data = collect(cfg, "jpeg")
    grid = curve_grid(cfg, data)
    assert grid[-1] == 82.0 and 57.0 in grid
    for arm, final in (("flow_grpo", -1.9345), ("nft", -1.5)):
        curve = on_grid(data[arm][0], "reward", grid)
        assert curve[np.isfinite(curve)][-1] == final  # the plotted curve ends at the table's final value
    assert "says nothing here" not in report  # the baseline gained: its final is a target to reach


def test_a_baseline_that_fell_makes_the_time_to_reach_moot(tmp_path):
    cfg = load_config(SweepConfig, SWEEP, [f"run_dir={tmp_path}", "budget_s=20", "eval_every_s=10", "seeds=[0]"])
    out = run_dir_of(cfg, "jpeg", "flow_grpo", 0)
    out.mkdir(parents=True)
    (out / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (_probe(0, 0.0, -2.0),
                                                                               _probe(1, 30.0, -2.5))))
    report = write_report(cfg).read_text()
    assert "flow_grpo ended at or below its start (-2.0000), so every run starts at the target" in report


def test_an_open_ended_progress_bar_has_no_eta(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1_000_000)
    logger.open_ended()
    logger.log(1, {"loss": 1.0})
    assert logger.bar.total is None and "remaining" not in str(logger.bar.format_dict)
    logger.close()
