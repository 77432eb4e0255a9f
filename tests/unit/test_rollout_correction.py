"""Rollout correction and weight packets without Ray: the truncated importance weights in closed form,
the corrected loss on a fixed stale buffer against a hand computation, and the LoRA packet's bytes and
checksum."""

import math

import pytest
import torch

from posttrain.grpo.engines.weight_sync import WeightPacket, WeightSyncError
from posttrain.grpo.update import transition_loss
from posttrain.grpo.parts.ppo_clip_kl import PPOClipKL
from posttrain.objectives.rollout_correction import CorrectionConfig, correction_weights, staleness_stats
from rollout.branches import CFGBranches
from rollout.sampler import log_prob
from tests.integration.test_grpo import _rollout, _setup

pytestmark = pytest.mark.core


def test_weights_are_one_on_fresh_rows_and_truncated_on_stale_ones():
    old = torch.tensor([0.0, 0.5, -0.5, 2.0, 0.3])
    mu = torch.zeros(5)
    stale = torch.tensor([False, True, True, True, False])
    w, keep = correction_weights(CorrectionConfig("tis", 2.0), old, mu, stale)
    assert w.tolist() == pytest.approx([1.0, math.exp(0.5), math.exp(-0.5), 2.0, 1.0], abs=1e-7)
    assert keep.all()
    w, keep = correction_weights(CorrectionConfig("reject", 2.0), old, mu, stale)
    assert torch.equal(w, torch.ones(5)) and keep.tolist() == [True, True, True, False, True]
    w, keep = correction_weights(CorrectionConfig("none", 2.0), old, mu, stale)
    assert torch.equal(w, torch.ones(5)) and keep.all()
    # nothing stale (sync): exactly 1, whatever pi_old / mu is
    w, _ = correction_weights(CorrectionConfig("tis", 2.0), old, mu, torch.zeros(5, dtype=torch.bool))
    assert torch.equal(w, torch.ones(5))
    assert staleness_stats(torch.tensor([3, 2, 1]), 3) == {"staleness_mean": 1.0, "staleness_max": 2}
    with pytest.raises(ValueError, match="cap"):
        CorrectionConfig("tis", 1.0).validate("grpo.rollout_correction.")


@pytest.mark.parametrize("mode", ["tis", "reject"])
def test_corrected_loss_on_a_fixed_stale_buffer_equals_a_hand_computation(tiny_export, mode):
    model, codec, train, null, policy, meta = _setup(tiny_export)
    traj = _rollout(model, codec, train, null, meta, n_prompts=3, group=2, batch=6)
    n, t, clip, cap = len(traj), 2, 0.2, 2.0
    delta = torch.tensor([0.3, -0.9, 1.2, 0.05, -0.2, 0.0])  # log pi_old - log mu per sample
    traj.old_log_probs = traj.log_probs + delta[:, None]
    traj.versions = torch.tensor([4, 3, 3, 4, 2, 3])  # trained at version 4: samples 1, 2, 4, 5 are stale
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.4, 2.0])
    mask = torch.tensor([True, True, True, True, False, True])
    loss_part = PPOClipKL(PPOClipKL.Config(clip_range=clip, beta=0.0))
    with torch.no_grad():
        got, stats = transition_loss(policy, traj, t, adv, mask, loss=loss_part, branches=CFGBranches(model),
                                     correction=CorrectionConfig(mode, cap), version=4)
        new = log_prob(model, traj, t).log_prob
    old = traj.old_log_probs[:, t]
    expected, count = 0.0, 0
    for i in range(n):
        stale = traj.versions[i] < 4
        w = math.exp(delta[i]) if stale else 1.0
        keep = bool(mask[i]) and (mode == "tis" or not stale or 1 / cap <= w <= cap)
        weight = min(w, cap) if mode == "tis" else 1.0
        if not keep:
            continue
        r = math.exp(float(new[i]) - float(old[i]))
        a = float(adv[i])
        expected += weight * max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
        count += 1
    assert float(got) == pytest.approx(expected / count, rel=1e-6, abs=1e-7)
    assert stats["is_weight_max"] <= cap
    if mode == "reject":  # of the stale 1, 2, 4, 5: e^-0.9 < 1/2 and e^1.2 > 2 are dropped
        assert stats["rejected_frac"] == pytest.approx(2 / 4)


def test_a_lora_packet_carries_the_adapters_only_and_a_corruption_is_caught(tiny_export):
    model, *_ , policy, _ = _setup(tiny_export)
    packet = WeightPacket.build(model, 3, lora=True)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert set(packet.tensors) == set(lora) and lora
    assert packet.nbytes == sum(p.numel() * 4 for p in lora.values())
    total = sum(p.numel() * 4 for p in model.parameters())
    assert packet.nbytes < total / 10
    name = next(iter(packet.tensors))
    packet.tensors[name] = packet.tensors[name].clone()
    packet.tensors[name].view(-1)[0] += 1e-3
    with pytest.raises(WeightSyncError, match="version 3.*checksum"):
        packet.apply(model)
    assert not torch.equal(dict(model.named_parameters())[name].detach(), packet.tensors[name])  # nothing copied
