"""Speed options keep the algorithm: the optimized training step gives the plain step's loss and
gradients; the LoRA-merged copy computes the policy's function; async scoring keeps sample order;
the profiler writes a Chrome trace."""

import pytest
import json
import random
from dataclasses import replace
import threading
import time

import torch

from posttrain.grpo.stage import train as grpo_train
from posttrain.grpo.update import GRPOAlgorithmConfig, GRPOUpdate, transition_loss
from posttrain.grpo.parts.ppo_clip_kl import PPOClipKL
from posttrain.grpo.perf import PerfConfig
from rollout.branches import CFGBranches
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import Runtime
from pretrain.runtime.metrics import read_metrics
from rewards.scoring import AsyncScorer
from tests.conftest import grpo_config
from tests.integration.test_grpo import STEPS, _rollout, _setup

pytestmark = pytest.mark.core


def _loss_and_grads(policy, traj, null, uncond_model, uncond_in_batch, per, rollout_uncond=False):
    """The mini-batch loss over transitions 0..STEPS-2 and the LoRA gradients, ``per`` transitions per
    forward (1 = one at a time, as flow_grpo)."""
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    adv = torch.linspace(0.5, 1.5, len(traj))  # one sign, so the loss is O(1) and a relative bound means something
    mask = torch.ones(len(traj), dtype=torch.bool)
    ts = list(range(STEPS - 1))
    total = 0.0
    for c in range(0, len(ts), per):
        chunk = ts[c:c + per]
        branches = CFGBranches(policy.model, True, uncond_model, uncond_in_batch, rollout_uncond)
        loss, _ = transition_loss(policy, traj, chunk, adv, mask, loss=PPOClipKL(PPOClipKL.Config(1e-4, 0.04)),
                                  branches=branches)
        (loss * len(chunk) / len(ts)).backward()
        total += loss.item() * len(chunk) / len(ts)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return total, grads


def test_optimized_step_has_the_plain_steps_loss_and_gradients(tiny_export):
    model, codec, train, null, policy, meta = _setup(tiny_export)
    traj = _rollout(model, codec, train, null, meta, n_prompts=2, group=2, batch=4)
    with torch.no_grad():  # move the policy off the rollout's weights so the ratio term is not trivial
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.01 * torch.randn_like(p))
    # flow_grpo: one transition per forward, one 2B forward with the unconditional half detached
    plain_loss, plain = _loss_and_grads(policy, traj, null, None, True, 1)
    scale = max(g.abs().max() for g in plain.values())
    assert scale > 0 and len(plain) > 0
    for per in (1, 2, STEPS - 1):  # LoRA-merged no-graph unconditional branch; 1, 2 and all transitions per forward
        fast_loss, fast = _loss_and_grads(policy, traj, null, policy.inference_model(0), False, per)
        assert abs(fast_loss - plain_loss) <= 1e-5 * abs(plain_loss), per
        assert plain.keys() == fast.keys()
        worst = max((fast[n] - plain[n]).abs().max() for n in plain)
        assert worst <= 1e-5 * scale, (per, worst, scale)


@pytest.mark.long
def test_compiled_blocks_with_sigmoid_gelu_give_the_plain_steps_loss_and_gradients(tiny_export):
    from posttrain.base.compile import compile_blocks
    from posttrain.grpo.perf import apply_model_options, resolve_perf

    model, codec, train, null, policy, meta = _setup(tiny_export)
    traj = _rollout(model, codec, train, null, meta, n_prompts=2, group=2, batch=4, record_uncond=True)
    plain_loss, plain = _loss_and_grads(policy, traj, null, None, True, 1)  # flow_grpo's layout, eager
    scale = max(g.abs().max() for g in plain.values())
    perf = resolve_perf(PerfConfig(compile=True), "fp32", False)
    assert perf.sigmoid_gelu and perf.merge_lora  # what perf.compile=true turns on with it
    apply_model_options(perf, model)
    merged = policy.inference_model(0)  # made before compiling, as GRPORun does
    for m in (model, merged):
        compile_blocks(m)
    for per, reuse in ((1, True), (STEPS - 1, False)):  # every speed option at once, then all transitions at once
        fast_loss, fast = _loss_and_grads(policy, traj, null, merged, False, per, rollout_uncond=reuse)
        assert abs(fast_loss - plain_loss) <= 1e-5 * abs(plain_loss), per
        worst = max((fast[n] - plain[n]).abs().max() for n in plain)
        assert worst <= 1e-5 * scale, (per, worst, scale)
    assert any(type(m).__name__ == "SigmoidGELU" for m in merged.modules())


def test_cpu_preset_reaches_the_run(tiny_export, tmp_path):
    from posttrain.grpo.stage import GRPORun

    run = GRPORun(grpo_config(tmp_path, tiny_export, "perf.preset=cpu", "train.steps=1", "data.limit=8"))
    blocks = run.st.model.blocks()
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)  # nn.Module.compile() happened
    assert any(type(m).__name__ == "SigmoidGELU" for m in run.st.model.modules())
    assert run.scorer.pool is None  # reward_workers 0: scored after the rollout
    run.scorer.close()
    run.logger.close()


def test_a_rollout_worker_takes_the_trainers_module_rewrites_and_compiled_layout(tiny_export, tmp_path):
    from posttrain.grpo.engines.worker import RolloutWorker
    from posttrain.grpo.perf import resolve_perf

    cfg = grpo_config(tmp_path, tiny_export, "perf.compile=true", "train.steps=1", "data.limit=8")
    perf = resolve_perf(cfg.perf, cfg.train.precision, False)
    threads = torch.get_num_threads()  # the worker sets engine.num_cpus threads in its (here: this) process
    try:
        worker = RolloutWorker(cfg, perf, record_uncond=False, index=0)
    finally:
        torch.set_num_threads(threads)
    merged = worker.policy.inference_model(-1)  # made before compiling, as in the trainer
    for model in (worker.policy.model, merged):
        blocks = model.blocks()
        assert blocks and all(b._compiled_call_impl is not None for b in blocks)
        assert any(type(m).__name__ == "SigmoidGELU" for m in model.modules())
    try:
        plain = RolloutWorker(cfg, resolve_perf(PerfConfig(), cfg.train.precision, False), False, 0)
    finally:
        torch.set_num_threads(threads)
    assert not any(type(m).__name__ == "SigmoidGELU" for m in plain.policy.model.modules())
    assert all(b._compiled_call_impl is None for b in plain.policy.model.blocks())


def test_rollout_uncond_velocities_give_the_plain_steps_loss_and_gradients(tiny_export):
    model, codec, train, null, policy, meta = _setup(tiny_export)  # LoRA B != 0: the KL term is live
    rolled = _rollout(model, codec, train, null, meta, n_prompts=2, group=2, batch=3, record_uncond=True)
    traj = rolled.select(torch.tensor([2, 0, 3, 1]))  # rollout batches of 3 + 1, concatenated, then shuffled
    plain_loss, plain = _loss_and_grads(policy, traj, null, None, True, 1)  # flow_grpo's layout
    scale = max(g.abs().max() for g in plain.values())
    assert traj.uncond_velocities.shape == (4, STEPS, *traj.latents.shape[2:]) and scale > 0
    for per in (1, 2, STEPS - 1):  # transition-major rows: the recorded velocities must line up with them
        fast_loss, fast = _loss_and_grads(policy, traj, null, None, False, per, rollout_uncond=True)
        assert abs(fast_loss - plain_loss) <= 1e-5 * abs(plain_loss), per
        worst = max((fast[n] - plain[n]).abs().max() for n in plain)
        assert worst <= 1e-5 * scale, (per, worst, scale)
    traj.uncond_velocities[:, 1] += 1.0  # a wrong recorded velocity moves the loss: the values are used
    moved, _ = _loss_and_grads(policy, traj, null, None, False, 1, rollout_uncond=True)
    assert abs(moved - plain_loss) > 1e-3 * abs(plain_loss)


def test_rollout_uncond_is_reused_only_before_the_first_optimizer_step(tiny_export, monkeypatch):
    import posttrain.grpo.update as update

    model, codec, train, null, policy, meta = _setup(tiny_export)
    traj = _rollout(model, codec, train, null, meta, n_prompts=3, group=2, batch=4, record_uncond=True)
    flags, real = [], update.transition_loss

    def spy(*args, **kwargs):
        flags.append(kwargs["branches"].reuse_recorded)
        return real(*args, **kwargs)

    monkeypatch.setattr(update, "transition_loss", spy)
    adv, mask = torch.linspace(-1, 1, 6), torch.ones(6, dtype=torch.bool)
    for accum, inner, want in ((1, 1, [True, False, False]), (3, 2, [True, True, True, False, False, False])):
        flags.clear()
        rt = Runtime(model, RuntimeConfig(steps=10, grad_accum=accum), OptimConfig(lr=1e-4), torch.device("cpu"),
                     "/tmp/unused")
        buffer = replace(traj)
        perf = PerfConfig(merge_lora=True)
        GRPOUpdate(GRPOAlgorithmConfig(inner_epochs=inner), perf)(policy, rt, buffer, adv, mask, transitions=[0],
                                                                   mini_batch_size=2, seed=0, iteration=0)
        assert flags == want, (accum, inner, flags)
        assert buffer.uncond_velocities is None  # stale after the step: a second pass over it recomputes
        flags.clear()
        GRPOUpdate(GRPOAlgorithmConfig(), perf)(policy, rt, buffer, adv, mask, transitions=[0], mini_batch_size=2,
                                                 seed=0, iteration=1)
        assert flags == [False] * 3


def test_grpo_iteration_records_and_reuses_the_rollout_uncond(tiny_export, tmp_path, monkeypatch):
    from rollout.sampler import Sampler

    recorded, real = [], Sampler.rollout

    def spy(self, *args, **kwargs):
        traj = real(self, *args, **kwargs)
        recorded.append(traj.uncond_velocities is not None)
        return traj

    monkeypatch.setattr(Sampler, "rollout", spy)
    first = {}
    for reuse in (True, False):  # one iteration: 2 mini-batches, the first before the optimizer step
        run = tmp_path / str(reuse)
        grpo_train(grpo_config(run, tiny_export, "train.steps=1", "data.limit=8", "rollout.prompts_per_step=2",
                               "rollout.group_size=2", "rollout.batch_size=4", "train.batch_size=2",
                               "eval.grid_prompts=2", f"perf.reuse_rollout_uncond={str(reuse).lower()}"))
        first[reuse] = read_metrics(run / "grpo/metrics.jsonl")[0]
    assert recorded == [True, False]
    for key in ("grad_norm", "ratio_mean", "ratio_min", "ratio_max"):
        assert abs(first[True][key] - first[False][key]) <= 1e-5 * abs(first[False][key]), key
    # the first ratios are 1, so the PPO term is about mean(advantage) = 0: compare it against the advantages' O(1)
    assert abs(first[True]["loss"] - first[False]["loss"]) <= 1e-6 and first[False]["grad_norm"] > 0


def test_merged_copy_follows_the_policy(tiny_export):
    model, codec, train, null, policy, meta = _setup(tiny_export)
    x, sigma = torch.randn(3, 3, 16, 16), torch.tensor([0.9, 0.5, 0.2])
    _, embeds, _ = train.batch([0, 1, 2])
    model.eval()
    merged = policy.inference_model(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(x, sigma, embeds), model(x, sigma, embeds), rtol=1e-5, atol=1e-5)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
        stale = merged(x, sigma, embeds)
        assert policy.inference_model(0) is merged  # same version: not refreshed
        fresh = policy.inference_model(1)(x, sigma, embeds)
        want = model(x, sigma, embeds)
    torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)
    assert (stale - want).abs().max() > 1e-3


def test_async_scoring_keeps_reward_i_with_sample_i():
    seen = []

    def slow_reward(images, prompts, metadata=None):
        time.sleep(random.uniform(0.0, 0.05))  # finish in a random order
        seen.append(threading.current_thread().name)
        r = images.flatten(1)[:, 0].clone()
        return r, {"first_pixel": r}

    scorer = AsyncScorer(slow_reward, workers=4)
    images = torch.arange(24, dtype=torch.float32).view(24, 1, 1, 1).expand(24, 3, 2, 2).contiguous()
    for start in range(0, 24, 3):
        scorer.submit(images[start:start + 3], [""] * 3)
    total, raw = scorer.gather()
    scorer.close()
    assert torch.equal(total, torch.arange(24, dtype=torch.float32))
    assert torch.equal(raw["first_pixel"], total)
    assert all(name.startswith("reward") for name in seen)


def test_profile_steps_write_a_chrome_trace(tiny_export, tmp_path):
    cfg = grpo_config(tmp_path, tiny_export, "train.steps=2", "profile.steps=[2]", "data.limit=8",
                      "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
                      "train.batch_size=4", "eval.grid_prompts=2")
    grpo_train(cfg)
    first = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]  # rollout on the merged copy, training on LoRA
    assert abs(first["ratio_min"] - 1) <= 1e-5 and abs(first["ratio_max"] - 1) <= 1e-5
    out = tmp_path / "grpo/profile"
    assert sorted(p.name for p in out.iterdir()) == ["step_2.trace.json", "step_2_memory.txt"]
    trace = json.loads((out / "step_2.trace.json").read_text())
    events = trace["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert "peak RSS" in (out / "step_2_memory.txt").read_text()


def test_async_scoring_overlaps_the_callers_work():
    def remote_like(images, prompts, metadata=None):  # 0.2 s of waiting per batch, as a served reward
        time.sleep(0.2)
        r = images.flatten(1).mean(1)
        return r, {"mean": r}

    images = torch.rand(4, 3, 2, 2)
    for workers, bound in ((1, (0.0, 0.1)), (0, (0.0, 0.05))):
        scorer = AsyncScorer(remote_like, workers=workers)
        t0 = time.perf_counter()
        for start in range(4):
            scorer.submit(images[start:start + 1], [""])
            time.sleep(0.2)  # the next rollout batch samples meanwhile
        total, _ = scorer.gather()
        elapsed = time.perf_counter() - t0
        scorer.close()
        torch.testing.assert_close(total, images.flatten(1).mean(1))
        assert bound[0] <= scorer.wait_seconds <= bound[1]  # threaded: the last batch is already scored
        # threaded: ~0.8 s (scoring hidden behind the caller's work); synchronous: ~1.6 s
        assert elapsed < 1.2 if workers else elapsed >= 1.6, (workers, elapsed)


def test_settings_that_cannot_hold_are_refused_never_rewritten(tiny_export, tmp_path):
    import pytest

    from posttrain.grpo.perf import resolve_perf
    from pretrain.config import ConfigError
    from tests.conftest import dpo_config

    with pytest.raises(ConfigError, match=r"perf\.merge_lora: true cannot be honoured with train\.precision=bf16"):
        grpo_config(tmp_path, tiny_export, "perf.merge_lora=true", "train.precision=bf16")  # at load: exit 2
    with pytest.raises(ConfigError, match=r"^perf\.merge_lora=true cannot be honoured with several ranks"):
        resolve_perf(PerfConfig(merge_lora=True), "fp32", True)  # under torchrun, checked when the job starts
    full = grpo_config(tmp_path, tiny_export, "perf.merge_lora=true", "train.precision=bf16", "policy.lora_rank=0")
    assert resolve_perf(full.perf, "bf16", False, lora=False).merge_lora is False  # nothing to merge: no-op
    auto = PerfConfig()
    assert auto.merge_lora is None
    assert (resolve_perf(auto, "fp32", False).merge_lora, resolve_perf(auto, "bf16", False).merge_lora,
            resolve_perf(auto, "fp32", True).merge_lora) == (True, False, False)
    with pytest.raises(ConfigError, match=r"perf\.uncond_in_batch.*not in .CompileConfig"):
        dpo_config(tmp_path, tiny_export, "perf.uncond_in_batch=true")
