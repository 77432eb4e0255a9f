"""`posttrain sweep`: arms race on equal training seconds, probed on the same held-out prompts; the
report and plots; a killed sweep resumes where it stopped."""

import json

import pytest

from posttrain.tools import sweep as sweep_mod
from posttrain.tools.sweep import run_sweep
from posttrain.tools.sweep_config import SweepConfig, read_rows
from posttrain.tools.sweep_report import mean_se, time_to
from pretrain.config import ConfigError, load_config
from tests.conftest import ROOT

pytestmark = pytest.mark.core

TINY = str(ROOT / "configs/grpo/emoji_tiny.yaml")
TINY_DPO = str(ROOT / "configs/dpo/emoji_tiny.yaml")


def _sweep_yaml(tmp_path, export, budget=6.0):
    text = f"""
run_dir: {tmp_path / 'sweep'}
pretrained: {export}
arms:
  flow_grpo: {{command: grpo, config: {TINY}, overrides: [rollout.prompts_per_step=2]}}
  awm: {{command: grpo, config: {TINY}, overrides: [rollout.prompts_per_step=2, rollout.step=ode,
         "~grpo.loss.clip_range", "~grpo.loss.beta", "grpo.loss={{name: awm, timesteps_per_sample: 1}}"]}}
  dpo: {{command: dpo, config: {TINY_DPO}, overrides: [online.prompts_per_round=2]}}
tasks:
  jpeg: {{reward: jpeg_compressibility, guard_reward: jpeg_incompressibility, overrides: ["rewards={{jpeg_compressibility: 1.0}}"]}}
seeds: [0]
budget_s: {budget}
eval_every_s: 3
baseline: flow_grpo
probe: {{num_prompts: 4, num_inference_steps: 3, guidance_scale: 2.0, guard_samples: 8}}
"""
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_time_to_target_interpolates_between_probes():
    rows = [{"train_s": 0.0, "reward": [0.0, 0.0]}, {"train_s": 10.0, "reward": [0.5, 0.5]},
            {"train_s": 20.0, "reward": [1.5, 0.5]}]
    assert time_to(rows, 0.75) == pytest.approx(15.0)  # 0.5 at 10 s, 1.0 at 20 s
    assert time_to(rows, -1.0) == 0.0 and time_to(rows, 2.0) is None
    m, se = mean_se([1.0, 3.0])
    assert m == 2.0 and se == pytest.approx(1.0)  # sd sqrt(2) / sqrt(2)


@pytest.mark.long
def test_sweep_runs_every_arm_and_resumes_after_a_kill(tiny_export, tmp_path, monkeypatch):
    path = _sweep_yaml(tmp_path, tiny_export)
    cfg = load_config(SweepConfig, path, [])
    real, calls = sweep_mod.step_once, {"n": 0}

    def dying(stage):  # killed during the awm run's second step, after its first probe checkpoint
        if "awm" in str(stage.st.run):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
        return real(stage)

    monkeypatch.setattr(sweep_mod, "step_once", dying)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, log=lambda m: None)
    awm = tmp_path / "sweep/jpeg/awm/seed0"
    assert (tmp_path / "sweep/jpeg/flow_grpo/seed0/done.json").exists() and not (awm / "done.json").exists()
    before = read_rows(awm / "probes.jsonl")
    monkeypatch.setattr(sweep_mod, "step_once", real)
    lines = []
    report = run_sweep(load_config(SweepConfig, path, []), log=lines.append)
    assert not any("flow_grpo/seed0] " in m and "iteration" in m for m in lines)  # finished: not rerun
    assert any("dpo/seed0] " in m and "iteration" in m for m in lines)
    after = read_rows(awm / "probes.jsonl")
    kept = [r for r in before if r["iteration"] <= after[len(before) - 1]["iteration"]]
    assert after[:len(kept)] == kept and after[-1]["train_s"] >= 6.0  # the probes it had, then to the budget
    assert [r["train_s"] for r in after] == sorted(r["train_s"] for r in after)
    for run in ("flow_grpo", "awm"):
        rows = read_rows(tmp_path / f"sweep/jpeg/{run}/seed0/probes.jsonl")
        assert rows[0]["iteration"] == 0 and rows[0]["train_s"] == 0.0 and len(rows[0]["reward"]) == 4
        assert rows[-1]["samples"] == rows[-1]["iteration"] * 8  # 2 prompts x group 4
        done = json.loads((tmp_path / f"sweep/jpeg/{run}/seed0/done.json").read_text())
        assert done["iterations"] == rows[-1]["iteration"]
    # both arms start from the same export and probe the same prompts and seeds: identical first probes
    first = [read_rows(tmp_path / f"sweep/jpeg/{r}/seed0/probes.jsonl")[0] for r in ("flow_grpo", "awm")]
    assert first[0]["reward"] == first[1]["reward"] and first[0]["guard_loss"] == first[1]["guard_loss"]
    text = report.read_text()
    assert "| flow_grpo | 1 |" in text and "| awm | 1 |" in text and "![jpeg](jpeg.png)" in text
    dpo = read_rows(tmp_path / "sweep/jpeg/dpo/seed0/probes.jsonl")  # 8 samples drawn every 5 steps
    assert dpo[-1]["train_s"] >= 6.0 and dpo[-1]["samples"] == 8 * ((dpo[-1]["iteration"] + 4) // 5)
    assert (tmp_path / "sweep/jpeg.png").stat().st_size > 10_000


def test_sweep_config_errors_name_the_key(tiny_export, tmp_path):
    path = _sweep_yaml(tmp_path, tiny_export)
    with pytest.raises(ConfigError, match=r"baseline: 'dgpo' is not an arm"):
        load_config(SweepConfig, path, ["baseline=dgpo"])
    with pytest.raises(ConfigError, match=r"run_tasks: \['clip'\] not in \['jpeg'\]"):
        load_config(SweepConfig, path, ["run_tasks=[clip]"])
    cfg = load_config(SweepConfig, path, ["arms.awm.overrides=[grpo.loss.nope=1]"])
    with pytest.raises(ConfigError, match=r"sweep arms\.awm \(task jpeg\): .*grpo\.loss\.nope"):
        run_sweep(cfg, log=lambda m: None)


def test_a_reward_gradient_arm_takes_its_command_overrides_not_the_rl_rewards():
    """The shipped shapes sweep: its RL arms train on ``rewards: {shapes: 1}``; the refl arm cannot take
    ``rewards`` (one differentiable ``reward``), so the task's ``command_overrides`` replace its overrides."""
    from posttrain.tools.sweep_config import arm_config

    cfg = load_config(SweepConfig, ROOT / "configs/sweep/shapes_algorithms.yaml")
    refl, nft = arm_config(cfg, "shapes", "refl", 1), arm_config(cfg, "shapes", "nft", 1)
    assert refl.reward == {"learned_judge": {"path": "runs/quickstart/train-reward/model"}}
    assert refl.guard.every == 0 and refl.train.seed == 1 and refl.data.layout == "reading"
    assert nft.rewards == {"shapes": 1.0}


def test_the_report_puts_the_trained_rewards_gain_beside_the_truths(tiny_export, tmp_path):
    """With ``trained_reward`` the table adds its paired gain and the headline gain minus it: on hand
    rows (2 prompts, 1 seed), truth 0.5 -> 0.6 on both prompts (+0.1) and the trained reward 0.2 -> 0.6
    (+0.4) give +0.4 and -0.3; an arm without trained-reward probes gets dashes."""
    from posttrain.tools.sweep_config import run_dir_of, write_rows
    from posttrain.tools.sweep_report import arm_table, collect

    path = _sweep_yaml(tmp_path, tiny_export)
    cfg = load_config(SweepConfig, path, ["tasks.jpeg.trained_reward=learned_judge@some/model"])

    def row(i, truth, trained=None):
        return {"iteration": i, "train_s": float(i), "samples": 8 * i, "reward": [truth, truth],
                "guard_reward": [0.0, 0.0], "guard_loss": 0.1,
                **({} if trained is None else {"trained_reward": [trained, trained]})}

    for arm, rows in {"flow_grpo": [row(0, 0.5, 0.2), row(3, 0.6, 0.6)], "awm": [row(0, 0.5), row(2, 0.5)]}.items():
        out = run_dir_of(cfg, "jpeg", arm, 0)
        out.mkdir(parents=True)
        write_rows(out / "probes.jsonl", rows)
    lines, _ = arm_table(cfg, "jpeg", collect(cfg, "jpeg"))
    assert lines[0].endswith("| trained reward learned_judge: gain (SE) | jpeg_compressibility gain minus it |")
    assert lines[1].count("---") == lines[0].count("|") - 1
    flow = next(line for line in lines if line.startswith("| flow_grpo |"))
    assert flow.endswith("| +0.4000 (0.0000) | -0.3000 |")
    assert next(line for line in lines if line.startswith("| awm |")).endswith("| - | - |")


def test_an_arm_budget_replaces_the_sweeps_and_the_table_gives_each_seeds_z(tiny_export, tmp_path):
    """``arms.<name>.budget_s`` is that arm's budget (others keep the sweep's; a negative one is refused by
    name), and the report names it. z per seed on hand rows (3 prompts): seed 0 moves 0 -> (1, 0, 1), mean
    2/3, SD sqrt(1/3), SE 1/3, z 2.0; seed 1 moves every prompt by +1 (SE 0: no z)."""
    from posttrain.tools.sweep_config import run_dir_of, write_rows
    from posttrain.tools.sweep_report import arm_table, collect, write_report

    path = _sweep_yaml(tmp_path, tiny_export)
    with pytest.raises(ConfigError, match=r"arms\.awm\.budget_s: -1\.0 is negative"):
        load_config(SweepConfig, path, ["arms.awm.budget_s=-1"])
    cfg = load_config(SweepConfig, path, ["arms.awm.budget_s=30", "seeds=[0,1]"])
    assert cfg.budget_of("awm") == 30 and cfg.budget_of("flow_grpo") == cfg.budget_s != 30

    def row(i, reward):
        return {"iteration": i, "train_s": float(i), "samples": 8 * i, "reward": reward,
                "guard_reward": [0.0] * 3, "guard_loss": 0.1}

    for seed, end in ((0, [1.0, 0.0, 1.0]), (1, [1.0, 1.0, 1.0])):
        for arm in ("flow_grpo", "awm"):
            out = run_dir_of(cfg, "jpeg", arm, seed)
            out.mkdir(parents=True)
            write_rows(out / "probes.jsonl", [row(0, [0.0] * 3), row(2, end)])
    lines, _ = arm_table(cfg, "jpeg", collect(cfg, "jpeg"))
    assert "| z | z per seed |" in lines[0]
    awm = next(line for line in lines if line.startswith("| awm |"))
    assert "| +2.0 / - |" in awm and awm.startswith("| awm | 2 | 2 | 1.0 / 1.0 |")  # 2 s over 2 iterations
    assert ", awm: 30 s (rollout" in write_report(cfg).read_text()
