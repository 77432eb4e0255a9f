"""Registered parts: an advantage estimator and a loss written in this file are chosen by name in the
config and train, with no project file edited; bad names and options, and a loss declaring what its
update engine, the rollout or the launch cannot give it, are config errors naming the key (exit 2)."""

import re
from dataclasses import dataclass

import pytest
import torch

from posttrain.grpo.stage import train as grpo_train
from posttrain.grpo.forward_update import ForwardBatch, ForwardDraw
from posttrain.grpo.parts.base import LossPart
from posttrain.grpo.parts.registry import ADVANTAGES, LOSSES
from pretrain.config import ConfigError
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config

pytestmark = pytest.mark.core

CALLS = []


class RankAdvantage:
    """Rank-based advantages: within each prompt group, the centred, standardised rank of each reward
    (ties broken by order), plus ``offset``."""

    @dataclass
    class Config:
        offset: float = 0.0

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, total, raw, weights, group_ids, prompt_ids):
        adv = torch.zeros_like(total)
        for g in torch.unique(group_ids):
            idx = torch.nonzero(group_ids == g).flatten()
            ranks = torch.argsort(torch.argsort(total[idx])).float()
            adv[idx] = (ranks - ranks.mean()) / ranks.std(unbiased=False)
        adv = adv + self.cfg.offset
        CALLS.append(adv.clone())
        valid = torch.isfinite(total)
        return adv, valid, torch.zeros_like(valid)


def _registered(registry, name, cls, calls):
    """Register ``cls`` as ``name`` for one test (its ``calls`` cleared), then remove it."""
    registry.register(name)(cls)
    calls.clear()
    yield
    registry.unregister(name)


@pytest.fixture
def rank_advantage():
    yield from _registered(ADVANTAGES, "test_rank", RankAdvantage, CALLS)


def test_rank_advantage_has_its_closed_form(rank_advantage):
    est = ADVANTAGES.build({"name": "test_rank", "offset": 0.25}, "grpo.advantage")
    adv, valid, zero = est(torch.tensor([0.3, 0.1, 0.9, 0.5, 2.0, 1.0]), {}, {}, torch.tensor([0, 0, 0, 0, 1, 1]),
                           torch.tensor([7, 7, 7, 7, 3, 3]))
    s = 1.25 ** 0.5  # population std of the ranks 0..3
    want = torch.tensor([-0.5 / s, -1.5 / s, 1.5 / s, 0.5 / s, 1.0, -1.0]) + 0.25
    torch.testing.assert_close(adv, want)
    assert valid.all() and not zero.any()


def test_grpo_trains_with_an_advantage_registered_in_a_test_file(rank_advantage, tiny_export, tmp_path):
    # beta 0 and one optimizer step per iteration: the first iteration's ratios are 1, so its loss is
    # mean(-A) over the samples = -offset exactly what this estimator returned (ranks are centred)
    cfg = grpo_config(tmp_path, tiny_export, "train.steps=2", "grpo.advantage.name=test_rank",
                      "grpo.advantage.offset=0.5", "grpo.loss.beta=0.0", "train.batch_size=16")
    grpo_train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert len(CALLS) == 2 and all(c.shape == (16,) for c in CALLS)
    assert abs(float(CALLS[0].mean()) - 0.5) < 1e-6
    for rec in recs:  # each iteration samples from the policy it trains: ratios start at 1 every time
        assert rec["ratio_min"] > 1 - 1e-5 and rec["ratio_max"] < 1 + 1e-5
        assert abs(rec["loss"] + 0.5) < 1e-4 and rec["grad_norm"] > 0, rec
    # with the built-in group estimator the advantages are centred: the same loss is about 0
    grpo_train(grpo_config(tmp_path / "group", tiny_export, "train.steps=1", "grpo.loss.beta=0.0", "train.batch_size=16"))
    assert abs(read_metrics(tmp_path / "group/grpo/metrics.jsonl")[0]["loss"]) < 1e-4


def test_a_part_named_by_import_path_needs_no_registration(tiny_export, tmp_path):
    # a file that sets the group estimator's option: remove it with ~key when switching parts
    with pytest.raises(ConfigError, match=r"grpo\.advantage\.clip_max: not an option of .* ~grpo\.advantage\.clip_max"):
        grpo_config(tmp_path, tiny_export, "grpo.advantage.clip_max=5.0",
                    "grpo.advantage.name=tests.integration.test_parts:RankAdvantage")
    cfg = grpo_config(tmp_path, tiny_export, "grpo.advantage.clip_max=5.0", "~grpo.advantage.clip_max",
                      "grpo.advantage.name=tests.integration.test_parts:RankAdvantage", "grpo.advantage.offset=2.0")
    est = cfg.grpo.build().advantage
    assert isinstance(est, RankAdvantage) and est.cfg.offset == 2.0
    adv, _, _ = est(torch.tensor([1.0, 3.0]), {}, {}, torch.tensor([0, 0]), torch.tensor([5, 5]))
    assert adv.tolist() == [1.0, 3.0]  # ranks -1, +1, plus 2


def test_unknown_part_names_and_options_name_the_key(tiny_export, tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.advantage\.name: unknown advantage estimator 'nope'; known: "):
        grpo_config(tmp_path, tiny_export, "grpo.advantage.name=nope")
    with pytest.raises(ConfigError, match=r"grpo\.loss\.clip_rang: not an option of policy loss 'ppo_clip_kl' "
                                          r"\(its options: clip_range, beta\)"):
        grpo_config(tmp_path, tiny_export, "grpo.loss.clip_rang=0.1")
    with pytest.raises(ConfigError, match=r"grpo\.loss\.clip_range: must be > 0"):
        grpo_config(tmp_path, tiny_export, "grpo.loss.clip_range=0")


# --- loss parts: a new one trains through the shipped update engine; what it declares is checked at load ---

FM_CALLS = []


class WeightedFlowMatching(LossPart):
    """Plain advantage-weighted flow matching on the forward process: masked mean of
    A * ||v - (eps - x0)||^2 / D (AWM without its KL terms)."""

    update = "forward"
    needs_log_probs = False

    @dataclass
    class Config(ForwardDraw):
        timesteps_per_sample: int = 2

    def __init__(self, cfg):
        self.cfg = self.draw = cfg

    def __call__(self, batch):
        FM_CALLS.append(type(batch))
        err = (batch.velocity.float() - (batch.noise - batch.x0)).pow(2).flatten(1).mean(1)
        loss = (batch.advantages * err * batch.mask.float()).sum() / batch.mask.float().sum().clamp(min=1.0)
        return loss, {"policy_loss": float(loss.detach())}


class GroupedTransitionLoss(LossPart):
    """A per-transition loss that declares whole-group mini-batches, which the transition update
    engine does not make."""

    needs_groups = True

    def __init__(self, cfg):
        self.cfg = cfg


class PlainLossWithoutBase:
    """A loss that declares nothing (not a LossPart)."""

    def __init__(self, cfg):
        self.cfg = cfg


@pytest.fixture
def weighted_fm():
    yield from _registered(LOSSES, "test_weighted_fm", WeightedFlowMatching, FM_CALLS)


ODE = ("rollout.step=ode", "~grpo.loss.clip_range", "~grpo.loss.beta")


def test_a_loss_registered_in_a_test_file_trains_through_the_forward_update(weighted_fm, tiny_export, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cfg = grpo_config(tmp_path, tiny_export, *ODE, "grpo.loss.name=test_weighted_fm", "train.steps=2",
                      "checkpoint.every=2")
    assert cfg.grpo.loss == {"name": "test_weighted_fm", "timesteps_per_sample": 2, "timestep_fraction": 1.0,
                             "shared_in_group": False}  # its defaults recorded
    grpo_train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    # 2 iterations x 2 mini-batches x 2 draws, each a ForwardBatch of the forward-process update
    assert FM_CALLS == [ForwardBatch] * 8
    assert len(recs) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert all(r["grad_norm"] > 0 and "ratio_mean" not in r for r in recs)
    dcp_to_torch_save(tmp_path / "grpo/checkpoints/step_2", tmp_path / "state.pt")
    model = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    lora_b = [k for k in model if "lora_B" in k]
    assert lora_b and any(model[k].abs().max() > 0 for k in lora_b)  # the policy moved off B = 0


def _cli(tmp_path, tiny_export, *overrides) -> int:
    from posttrain.cli import main
    from tests.conftest import ROOT

    return main(["grpo", str(ROOT / "configs/grpo/emoji_tiny.yaml"), f"run_dir={tmp_path}",
                 f"model.pretrained={tiny_export}", *overrides])


def test_a_capability_the_engines_lack_is_refused_at_config_load(weighted_fm, tiny_export, tmp_path, capsys,
                                                                 monkeypatch):
    import posttrain.base.stage as stage_mod

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a config the check refuses")

    monkeypatch.setattr(stage_mod.PolicyStage, "setup", no_model)
    path = "tests.integration.test_parts:GroupedTransitionLoss"
    cases = [  # (overrides, the key and the words the message must hold)
        ((f"grpo.loss.name={path}", "~grpo.loss.clip_range", "~grpo.loss.beta"),
         rf"grpo\.loss\.name: '{path}' declares needs_groups, which its update engine 'transition' lacks"),
        (("rollout.step=ode",), r"grpo\.loss\.name: 'ppo_clip_kl' trains on the rollout's log-probs; rollout\.step 'ode'"),
        ((*ODE, "grpo.loss.name=test_weighted_fm", "engine.name=ray"),
         r"engine\.name: ray trains with the update engines transition; grpo\.loss\.name 'test_weighted_fm'"),
        (("grpo.loss.name=tests.integration.test_parts:PlainLossWithoutBase", "~grpo.loss.clip_range",
          "~grpo.loss.beta"), r"grpo\.loss\.name: '.*PlainLossWithoutBase' is not a loss part"),
        ((*ODE, "grpo.loss.name=awm", "grpo.loss.timesteps_per_sample=6"),
         r"grpo\.loss\.timesteps_per_sample: 6 > the 4 schedule sigmas"),
        ((*ODE, "grpo.loss.name=dgpo", "grpo.loss.timesteps_per_sample=2", "train.batch_size=6",
          "rollout.prompts_per_step=3"),
         r"train\.batch_size: .* whole groups of 4; 6 is not a multiple"),
    ]
    from posttrain.grpo.parts.base import ROLLOUT_ENGINE_UPDATES

    monkeypatch.setitem(ROLLOUT_ENGINE_UPDATES, "ray", ("transition",))  # a rollout engine without the forward update
    for overrides, message in cases:
        assert _cli(tmp_path, tiny_export, *overrides) == 2, overrides
        err = capsys.readouterr().err
        assert re.search(message, err), err
    # what cannot run under torchrun is refused before any process group or model: an update engine that
    # runs in one process (the forward update, declared so here), the guard's best export
    from posttrain.grpo.forward_update import ForwardProcessUpdate

    monkeypatch.setattr(ForwardProcessUpdate, "distributed", False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _cli(tmp_path, tiny_export, *ODE, "grpo.loss.name=test_weighted_fm") == 2
    assert re.search(r"grpo\.loss\.name: 'test_weighted_fm' trains with the update engine 'forward', which runs "
                     r"in one process", capsys.readouterr().err)
    assert _cli(tmp_path, tiny_export, "guard.every=1", "guard.export=best") == 2
    assert "guard.export: 'best' keeps one process's unsharded weights" in capsys.readouterr().err


def test_the_cli_exits_2_naming_the_key_for_a_loss_that_needs_log_probs_on_ode(tiny_export, tmp_path, capsys):
    from posttrain.cli import main
    from tests.conftest import ROOT

    code = main(["grpo", str(ROOT / "configs/grpo/emoji_tiny.yaml"), f"run_dir={tmp_path}",
                 f"model.pretrained={tiny_export}", "rollout.step=ode"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "grpo.loss.name: 'ppo_clip_kl' trains on the rollout's log-probs" in err
    assert not (tmp_path / "grpo").exists()  # refused before the stage wrote anything
