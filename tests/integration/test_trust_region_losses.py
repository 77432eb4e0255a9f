"""Flow-DPPO and GRPO-Guard on the tiny preset: the rollout records each transition's Gaussian mean, the first
mini-batch of every iteration sees ratio 1 and nothing masked, later epochs move away from the old policy
(and the mask or the clip acts on them), and ``grpo.old_log_prob: recompute`` recomputes the means too."""

import pytest

from posttrain.grpo import update as update_module
from posttrain.grpo.stage import train as grpo_train
from pretrain.runtime.metrics import read_metrics
from tests.conftest import grpo_config

pytestmark = pytest.mark.core


def _record_means(monkeypatch):
    """Every old-mean batch the losses received, and the trajectory means they came from."""
    seen = []
    real = update_module.transition_loss

    def spy(policy, traj, t, *args, **kw):
        seen.append(traj.means is not None and traj.means.shape[:2] == traj.log_probs.shape)
        return real(policy, traj, t, *args, **kw)

    monkeypatch.setattr(update_module, "transition_loss", spy)
    return seen


@pytest.mark.parametrize("loss", [["grpo.loss.name=flow_dppo", "~grpo.loss.clip_range"],
                                  ["grpo.loss.name=grpo_guard"]], ids=["flow_dppo", "grpo_guard"])
def test_first_minibatch_is_on_policy_and_later_epochs_move(loss, tiny_export, tmp_path, monkeypatch):
    seen = _record_means(monkeypatch)
    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=2", "train.batch_size=8", "grpo.inner_epochs=2",
                           "grpo.loss.beta=0.0", *loss))
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert len(recs) == 2 and seen and all(seen)  # every mini-batch had the rollout's [B, T, *latent] means
    for rec in recs:
        assert rec["ratio_max"] > 1 + 1e-6 or rec["ratio_min"] < 1 - 1e-6  # 4 mini-batches: the policy moved
        if "masked_frac" in rec:
            assert rec["kl_old_max"] > 0.0  # later mini-batches are off the old policy


@pytest.mark.parametrize("loss", [["grpo.loss.name=flow_dppo", "~grpo.loss.clip_range"],
                                  ["grpo.loss.name=grpo_guard"]], ids=["flow_dppo", "grpo_guard"])
def test_one_minibatch_per_iteration_is_ratio_one(loss, tiny_export, tmp_path):
    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=2", "train.batch_size=16", "grpo.loss.beta=0.0",
                           *loss))
    for rec in read_metrics(tmp_path / "grpo/metrics.jsonl"):
        assert rec["ratio_min"] > 1 - 1e-5, rec  # on-policy: the recomputed log-probs are the rollout's
        assert rec["ratio_max"] < 1 + 1e-5, rec
        assert rec.get("masked_frac", 0.0) == 0.0 and rec["grad_norm"] > 0


@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_replaces_the_rollouts_means(recompute, tiny_export, tmp_path, monkeypatch):
    """The rollout's recorded means are shifted by 0.1 on purpose: with ``grpo.old_log_prob: recompute``
    the update recomputes them (the first mini-batch's KL to them is 0 up to rounding), without it the
    loss sees the shifted ones."""
    from rollout.sampler import Sampler

    kls, sample = [], Sampler.sample

    def shifted(self, *args, **kw):
        traj = sample(self, *args, **kw)
        if traj.means is not None:
            traj.means = traj.means + 0.1
        return traj

    real = __import__("posttrain.objectives.trust_region", fromlist=["x"]).divergence_masked_loss

    def spy(*args, **kw):
        loss, stats = real(*args, **kw)
        kls.append(stats["kl_old_max"])
        return loss, stats

    monkeypatch.setattr(Sampler, "sample", shifted)
    monkeypatch.setattr("posttrain.grpo.parts.flow_dppo.divergence_masked_loss", spy)
    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=1", "train.batch_size=16", "grpo.loss.beta=0.0",
                           "grpo.loss.name=flow_dppo", "~grpo.loss.clip_range",
                           f"grpo.old_log_prob={'recompute' if recompute else 'rollout'}"))
    assert kls
    assert (max(kls) < 1e-10) if recompute else (min(kls) > 1e-3), kls


def test_grpo_guard_reweight_needs_the_sde_step(tiny_export, tmp_path):
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"grpo\.loss\.reweight: the 1 / \|dt\| weights need rollout\.step: sde"):
        grpo_config(tmp_path, tiny_export, "grpo.loss.name=grpo_guard", "rollout.step=cps")
    grpo_config(tmp_path, tiny_export, "grpo.loss.name=grpo_guard", "rollout.step=cps", "grpo.loss.reweight=false")


def test_a_loss_that_needs_old_means_is_refused_by_the_forward_engine():
    from posttrain.grpo.parts.base import LossPart, check_loss

    class NeedsMeans(LossPart):
        update = "forward"
        needs_log_probs = False
        needs_old_means = True

    with pytest.raises(ValueError, match=r"grpo\.loss\.name: 'x' declares needs_old_means"):
        check_loss(NeedsMeans, "x", step="ode", rollout_engine="local", world_size=1)
