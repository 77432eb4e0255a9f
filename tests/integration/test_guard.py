"""The reward-hacking guard: within-group diversity in closed form, the failing rule, and on the tiny
preset a run that stops early, stays stopped on resume, and exports the check the guard chose."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from posttrain.grpo.stage import train as grpo_train
from posttrain.base.guard import LOSS, Guard, GuardConfig, group_diversity
from pretrain.runtime.metrics import read_metrics
from rewards.base import REGISTRY, register
from tests.conftest import grpo_config

pytestmark = pytest.mark.core


def test_group_diversity_closed_form():
    a = torch.zeros(1, 3, 8, 8)
    pair = torch.cat([a, a + 0.3])  # every pixel differs by 0.3: RMS distance 0.3
    same = torch.cat([a + 0.5, a + 0.5])
    images = torch.cat([pair, same])
    groups = torch.tensor([0, 0, 1, 1])
    assert group_diversity(pair, torch.tensor([0, 0])) == pytest.approx(0.3)
    assert group_diversity(images, groups) == pytest.approx(0.15)  # mean of 0.3 and 0
    assert math.isnan(group_diversity(images, torch.arange(4)))  # no group of two
    videos = torch.stack([pair, pair], dim=1)  # [2, 2 frames, 3, 8, 8]
    assert group_diversity(videos, torch.tensor([0, 0])) == pytest.approx(0.3)
    big = torch.cat([torch.zeros(1, 3, 256, 256), torch.full((1, 3, 256, 256), 0.2)])
    assert group_diversity(big, torch.tensor([0, 0])) == pytest.approx(0.2)  # pooled to 64 px first


def _guard(tmp_path, trained=True, **cfg):
    g = Guard(GuardConfig(every=1, **cfg), SimpleNamespace(run=tmp_path), (lambda *a: None) if trained else None)
    g.baseline = {LOSS: 0.2, "trained": -1.0}
    return g


def test_a_check_fails_when_the_reward_rises_and_a_guard_worsens(tmp_path):
    g = _guard(tmp_path)
    assert g.failures({LOSS: 0.26}, -0.9, 0.4) == [
        "held-out flow-matching loss 0.2 -> 0.26 (worse by 30% > 10%; trained reward -1 -> -0.9)"]
    assert g.failures({LOSS: 0.215}, -0.9, 0.4) == []  # 7.5 % worse: within the threshold
    assert g.failures({LOSS: 0.26}, -1.05, 0.4) == []  # the trained reward fell 5 %: neither hacking nor collapse
    assert _guard(tmp_path, worse_by={LOSS: 0.5}).failures({LOSS: 0.26}, -0.9, 0.4) == []
    assert _guard(tmp_path, trained=False).failures({LOSS: 0.26}, float("nan"), 0.4)[0].startswith(
        "held-out flow-matching loss 0.2 -> 0.26 (worse by 30% > 10%)")  # no trained reward: the guard alone
    assert _guard(tmp_path, min_diversity=0.05).failures({LOSS: 0.2}, -1.0, 0.01) == [
        "within-group diversity 0.01 < min_diversity 0.05"]


def test_a_check_fails_when_the_reward_collapses_with_a_guard(tmp_path):
    """A run falling apart (trained reward down 50 %, held-out loss up 30x, as NFT in bf16 did on the GPU
    base preset: docs/results.md) fails even though nothing was hacked; a small fall or a fall with every
    guard within its threshold passes, and collapse_by 0 restores the hacking-only rule."""
    g = _guard(tmp_path)
    assert g.failures({LOSS: 6.0}, -1.5, 0.4) == [
        "held-out flow-matching loss 0.2 -> 6 (worse by 2900% > 10%; trained reward -1 -> -1.5 (collapse: it fell too))"]
    assert g.failures({LOSS: 0.21}, -1.5, 0.4) == []  # the loss within 10 %: a bad step, no guard against it
    assert g.failures({LOSS: 6.0}, -1.09, 0.4) == []  # fell 9 % < collapse_by 10 %
    assert g.failures({LOSS: 6.0}, float("nan"), 0.4)[0].startswith("held-out flow-matching loss 0.2 -> 6")  # no score
    assert _guard(tmp_path, collapse_by=0.0).failures({LOSS: 6.0}, -1.5, 0.4) == []
    assert _guard(tmp_path, collapse_by=0.6).failures({LOSS: 6.0}, -1.5, 0.4) == []


@pytest.mark.parametrize("override, key", [({"export": "best"}, "every"), ({"every": 1, "worse_by": {"judge": 0.1}},
                                                                         "worse_by"), ({"every": -1}, "every"),
                                           ({"every": 1, "rewards": ["jpeg_compressibility", "jpeg_compressibility"]},
                                            "rewards"), ({"every": 1, "collapse_by": -0.1}, "collapse_by")])
def test_guard_config_errors_name_the_key(override, key):
    with pytest.raises(ValueError, match=rf"^guard\.{key}: "):
        GuardConfig(**override).validate("guard.")


if "test_brightness" not in REGISTRY:
    @register("test_brightness")
    def _brightness():
        return lambda images, prompts=None, metadata=None: images.float().mean(dim=(1, 2, 3))

PROBE = ("guard.num_prompts=8", "guard.num_inference_steps=6", "guard.loss_samples=32", "guard.guidance_scale=1.0")
RISING = ("rewards.jpeg_compressibility=0", "rewards.test_brightness=1.0", "optim.lr=5e-3", "grpo.loss.clip_range=0.05",
          "grpo.loss.beta=0.0", "rollout.guidance_scale=1.0", "data.limit=4", "rollout.group_size=8",
          "rollout.batch_size=16", "train.batch_size=16")


def test_the_guard_stops_a_run_and_a_resume_stays_stopped(tiny_export, tmp_path):
    # any rise of the held-out loss counts as worse (a 1e-6 threshold) while brightness is rewarded
    args = ("train.steps=8", "guard.every=1", "guard.stop=true", "guard.checks=2", "guard.default_worse_by=1e-6",
            "checkpoint.every=0", *PROBE, *RISING)
    grpo_train(grpo_config(tmp_path, tiny_export, *args))
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    checks = [r for r in recs if "guard/loss" in r]
    assert checks[0]["step"] == 0 and checks[0]["guard/failing"] == 0  # the baseline, before any update
    stop = checks[-1]
    assert stop["step"] < 8 and stop["guard/streak"] == 2 and recs[-1]["step"] == stop["step"]
    assert stop["guard/loss"] > checks[0]["guard/loss"] and stop["guard/trained"] > checks[0]["guard/trained"]
    assert (tmp_path / "grpo/export/posttrain.json").is_file()  # stopped early, and exported
    assert sorted(p.name for p in (tmp_path / "grpo/checkpoints").glob("step_*")) == [f"step_{stop['step']}"]
    assert (tmp_path / f"grpo/samples/guard_step_{stop['step']:05d}.png").is_file()
    grpo_train(grpo_config(tmp_path, tiny_export, *args, "checkpoint.resume=true"))  # stays stopped: no new step
    assert read_metrics(tmp_path / "grpo/metrics.jsonl") == recs


def test_export_best_is_the_check_the_guard_chose(tiny_export, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=4", "guard.every=1", "guard.export=best",
                           "guard.default_worse_by=100", "checkpoint.every=1", "checkpoint.keep_last=10",
                           *PROBE, *RISING))
    best = json.loads((tmp_path / "grpo/guard/best.json").read_text())
    checks = {r["step"]: r for r in read_metrics(tmp_path / "grpo/metrics.jsonl") if "guard/trained" in r}
    assert best["step"] == max(checks, key=lambda s: checks[s]["guard/trained"])  # no check failed
    assert all(r["guard/best_step"] == max((s for s in checks if s <= step), key=lambda s: checks[s]["guard/trained"])
               for step, r in checks.items())
    lora = {k.replace(".default", ""): v for k, v in load_file(str(tmp_path / "grpo/guard/best.safetensors")).items()}
    exported = load_file(str(tmp_path / "grpo/lora/pytorch_lora_weights.safetensors"))
    assert lora.keys() == exported.keys() and all(torch.equal(lora[k], exported[k]) for k in lora)
    assert best["step"] > 0  # brightness rises: a trained check beats the baseline
    dcp_to_torch_save(tmp_path / f"grpo/checkpoints/step_{best['step']}", tmp_path / "best.pt")
    ckpt = torch.load(tmp_path / "best.pt", weights_only=False)["model"]  # the checkpoint of that iteration
    assert all(torch.equal(ckpt[k.replace("lora_A.", "lora_A.default.").replace("lora_B.", "lora_B.default.")], v)
               for k, v in lora.items())


def test_online_dpo_runs_the_same_guard(tiny_export, tmp_path):
    """The DPO stage's guard probes its own policy: the baseline equals the probe computed here by hand on
    the export (LoRA B = 0 at step 0), and the check at step 5 equals the probe of the exported policy."""
    from posttrain.base.guard import GuardConfig
    from posttrain.base.stage import PolicyStage
    from posttrain.dpo.stage import train as dpo_train
    from posttrain.eval.probe import probe_scores, prompt_mean
    from pretrain.export import load_exported
    from rewards.base import CompositeReward
    from tests.conftest import dpo_config

    cfg = dpo_config(tmp_path, tiny_export, "guard.every=5", *PROBE)  # 5 steps
    dpo_train(cfg)
    checks = [r for r in read_metrics(tmp_path / "dpo/metrics.jsonl") if "guard/loss" in r]
    assert [r["step"] for r in checks] == [0, 5]
    assert (tmp_path / "dpo/samples/guard_step_00005.png").is_file()

    probe_cfg = GuardConfig(every=5, num_prompts=8, num_inference_steps=6, loss_samples=32,
                            guidance_scale=1.0).probe_config()
    trained = CompositeReward(cfg.rewards)
    fns = {"trained": lambda images, prompts, metadata=None: trained(images, prompts)[0]}
    st = PolicyStage.setup(dpo_config(tmp_path / "probe", tiny_export, *PROBE), "probe")
    for check, model in ((checks[0], st.model), (checks[1], load_exported(tmp_path / "dpo/export")[0])):
        scores, loss, *_ = probe_scores(model, st, probe_cfg, fns)
        assert check["guard/loss"] == pytest.approx(loss, rel=1e-4)
        assert check["guard/trained"] == pytest.approx(prompt_mean(scores["trained"]), rel=1e-4, abs=1e-4)
    assert checks[1]["guard/trained"] != checks[0]["guard/trained"]  # the policy moved between the checks


def test_switching_the_guard_on_at_resume_is_refused_naming_it(tiny_export, tmp_path):
    from pretrain.config import ConfigError

    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=1"))
    with pytest.raises(ConfigError, match=r"^guard\.every: the checkpoint .* was written with 'off', this run has 'on'"):
        grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=2", "guard.every=1", "checkpoint.resume=true"))
