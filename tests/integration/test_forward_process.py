"""The forward-process losses on the GRPO stage: ODE rollouts (``rollout.step: ode``, no log-probs),
the old copy of DiffusionNFT checkpointed with the run, the checks naming their keys."""

import pytest
import torch

from posttrain.grpo.stage import train as grpo_train
from pretrain.config import ConfigError
from pretrain.runtime.metrics import read_metrics
from rollout.config import RolloutConfig
from rollout.sampler import Sampler
from tests.conftest import grpo_config
from tests.integration.test_grpo import STEPS, _setup

pytestmark = pytest.mark.core

ODE = ("rollout.step=ode", "~grpo.loss.clip_range", "~grpo.loss.beta")
LOSSES = {"nft": "grpo.loss={name: nft, timesteps_per_sample: 2}",
          "awm": "grpo.loss={name: awm, timesteps_per_sample: 2, advantage_scale: 1.0}",
          "dgpo": "grpo.loss={name: dgpo, timesteps_per_sample: 2, beta: 10.0}"}


@pytest.mark.parametrize("solver", ["euler", "dpmpp_2m"])
def test_the_ode_rollout_is_the_deterministic_sampler(tiny_export, solver):
    """``step: ode`` takes every transition with ``ode_solver``: with euler it is the evaluation's ODE
    sampler bit for bit (the same CFG call), with log-probs all 0 and nothing to train."""
    from pretrain.export import load_exported
    from pretrain.flow import euler_sample
    from pretrain.guidance import guided_velocity

    model, codec, train, null, policy, meta = _setup(tiny_export)
    _, encoder, _, _ = load_exported(tiny_export)
    model.eval()
    cfg = RolloutConfig(step="ode", ode_solver=solver, num_inference_steps=STEPS, group_size=2, batch_size=4,
                        shift=1.0, guidance_scale=2.0)
    sampler = Sampler.build(cfg, model, encoder, "cpu", shift=1.0)
    shape = (codec.channels, meta["image_size"], meta["image_size"])
    traj = sampler.rollout(model, codec, train, [0, 1], latent_shape=shape, seed=0, iteration=0, device="cpu")
    assert traj.settings.window == (0, 0) and sampler.train_transitions(0, 0) == []
    assert torch.count_nonzero(traj.log_probs) == 0
    if solver == "euler":
        _, embeds, _ = train.batch([0, 0, 1, 1])
        with torch.no_grad():
            want = euler_sample(lambda x, s: guided_velocity(model, x, s, embeds, sampler.settings.negative, 2.0),
                                traj.latents[:, 0], sampler.settings.sigmas)
        assert torch.equal(traj.latents[:, -1], want)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_forward_process_losses_train_and_move_the_policy(tiny_export, tmp_path, name):
    """Each loss trains: every optimizer step moves the adapter. LoRA B starts at 0 and Adam's first step
    moves each entry with a non-zero gradient by about lr (m / sqrt(v) = sign(g)), so after the run most
    lora_B entries are at least lr / 2 from 0; a loss with no gradient, or a step never taken, leaves them at 0."""
    from safetensors.torch import load_file

    one_step = ("train.batch_size=16",) if name == "dgpo" else ()  # one optimizer step per iteration
    cfg = grpo_config(tmp_path, tiny_export, *ODE, LOSSES[name], "train.steps=2", *one_step)
    grpo_train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert len(recs) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert recs[0]["grad_norm"] > 0 and "ratio_mean" not in recs[0]
    lora = load_file(str(tmp_path / "grpo/lora/pytorch_lora_weights.safetensors"))
    moved = torch.cat([v.flatten() for k, v in lora.items() if "lora_B" in k]).abs()
    assert moved.numel() > 0 and moved.median() >= 0.5 * cfg.optim.lr, moved.median()
    if name == "dgpo":  # policy = reference before the first step: ln 2
        assert recs[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)
    if name == "nft":
        assert recs[0]["old_decay"] == pytest.approx(0.001)


def test_nft_resume_restores_the_old_copy_bitwise(tiny_export, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    args = (*ODE, LOSSES["nft"], "checkpoint.every=1", "checkpoint.keep_last=5")
    grpo_train(grpo_config(tmp_path / "a", tiny_export, *args, "train.steps=3"))
    grpo_train(grpo_config(tmp_path / "b", tiny_export, *args, "train.steps=2"))
    grpo_train(grpo_config(tmp_path / "b", tiny_export, *args, "train.steps=3", "checkpoint.resume=true"))
    states = {}
    for run in ("a", "b"):
        dcp_to_torch_save(tmp_path / run / "grpo/checkpoints/step_3", tmp_path / f"{run}.pt")
        states[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    a, b = states["a"], states["b"]
    old_a, old_b = a["sharded"]["grpo.old_policy"], b["sharded"]["grpo.old_policy"]
    assert old_a and all(torch.equal(old_a[k], old_b[k]) for k in old_a)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # the old copy has moved off the initial adapter (B = 0)
    assert any(old_a[k].abs().max() > 0 for k in old_a if "lora_B" in k)
    ra = [r["reward_mean"] for r in read_metrics(tmp_path / "a/grpo/metrics.jsonl")]
    rb = [r["reward_mean"] for r in read_metrics(tmp_path / "b/grpo/metrics.jsonl")]
    assert ra == rb


def test_log_prob_losses_refuse_the_ode_step_and_dgpo_needs_whole_groups(tiny_export, tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.loss\.name: 'ppo_clip_kl' trains on the rollout's log-probs"):
        grpo_config(tmp_path, tiny_export, *ODE)
    with pytest.raises(ConfigError, match=r"rollout\.sde_window: step 'ode' is deterministic"):
        grpo_config(tmp_path, tiny_export, *ODE, LOSSES["awm"], "rollout.sde_window.size=2")
    with pytest.raises(ConfigError, match=r"grpo\.loss\.old_decay: start and rate"):
        grpo_config(tmp_path, tiny_export, *ODE, "grpo.loss={name: nft, old_decay: {max: 1.5}}")
    with pytest.raises(ValueError, match=r"train\.batch_size: .* whole groups of 4; 6 is not a multiple"):
        grpo_train(grpo_config(tmp_path, tiny_export, *ODE, LOSSES["dgpo"], "train.batch_size=6",
                               "rollout.prompts_per_step=3"))
