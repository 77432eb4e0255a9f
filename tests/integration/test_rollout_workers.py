"""Rollout workers on Ray (local cluster, tiny preset): sync with 2 workers equals the colocated run,
one_step_off / async staleness with a slow worker, a worker killed mid-iteration, and a corrupted
weight push caught by its checksum."""

import threading
import time

import pytest
import torch

from tests.conftest import require_extra  # noqa: E402

pytestmark = pytest.mark.core

ray = require_extra("ray", "ray")

from posttrain.grpo.engines.weight_sync import WeightPacket, WeightSyncError  # noqa: E402
from posttrain.grpo.stage import GRPORun  # noqa: E402
from pretrain.runtime.loop import run_stage  # noqa: E402
from pretrain.runtime.metrics import read_metrics  # noqa: E402
from tests.conftest import grpo_config  # noqa: E402

RAY = ("engine.name=ray", "engine.workers=2", "train.threads=1", "eval.grid_prompts=4", "checkpoint.every=0")


def _lora(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "grpo" / "lora" / "pytorch_lora_weights.safetensors"))


def test_sync_with_two_workers_equals_the_colocated_run(tiny_export, tmp_path, ray_cluster, capsys):
    local = GRPORun(grpo_config(tmp_path / "local", tiny_export, "train.threads=1", "eval.grid_prompts=4",
                                "checkpoint.every=0"))
    workers = GRPORun(grpo_config(tmp_path / "ray", tiny_export, *RAY, "reward_engine.engine=ray"))  # reward actor
    a, b = local.engine.collect(0), workers.engine.collect(0)
    assert torch.equal(a.traj.images, b.traj.images) and torch.equal(a.traj.latents, b.traj.latents)
    assert torch.equal(a.traj.log_probs, b.traj.log_probs)
    assert torch.equal(a.total, b.total) and torch.equal(a.group_ids, b.group_ids)
    adv = [r.parts.advantage(x.total, x.raw, r.rewards.weights, x.group_ids,
                             torch.as_tensor(x.picked)[x.group_ids])[0] for r, x in ((local, a), (workers, b))]
    assert torch.equal(adv[0], adv[1])
    assert b.metrics["rollout_requests_per_worker"] == "1,1"  # 16 samples in two requests of 8, one each
    # a LoRA push carries the adapter tensors only
    adapters = {n: p for n, p in workers.st.policy.model.named_parameters() if "lora_" in n}
    assert b.metrics["weight_sync_tensors"] == len(adapters)
    assert b.metrics["weight_sync_bytes"] == sum(p.numel() * p.element_size() for p in adapters.values())
    local.engine.close()
    workers.engine.close()
    # two whole iterations, weights pushed through the object store: the LoRA within 1e-6, every iteration
    # on-policy (no importance weight); the collective push and a resume that switches engines: long tier
    _two_iterations_equal(tiny_export, tmp_path, ("object_store",), capsys)


@pytest.mark.long  # make test syncs through the collective group in test_worker_lora_sync.py
def test_collective_sync_and_a_resume_onto_workers_equal_the_colocated_run(tiny_export, tmp_path, ray_cluster,
                                                                            capsys):
    la = _two_iterations_equal(tiny_export, tmp_path, ("collective",), capsys)
    # a run checkpointed on the local engine resumes on the workers and ends where the local run ends
    args = ("train.threads=1", "eval.grid_prompts=4", "checkpoint.every=1")
    run_stage(GRPORun(grpo_config(tmp_path / "switch", tiny_export, *args, "train.steps=1")))
    run_stage(GRPORun(grpo_config(tmp_path / "switch", tiny_export, *args, "train.steps=2", "checkpoint.resume=true",
                                  "engine.name=ray", "engine.workers=2")))
    lc = _lora(tmp_path / "switch")
    assert max((la[k] - lc[k]).abs().max().item() for k in la) <= 1e-6


def _two_iterations_equal(tiny_export, tmp_path, syncs, capsys) -> dict:
    """Two iterations on the local engine and on 2 sync workers per weight-sync path in ``syncs``: the
    LoRA within 1e-6, every iteration on-policy (no importance weight). Returns the local LoRA."""
    run_stage(GRPORun(grpo_config(tmp_path / "local2", tiny_export, "train.threads=1", "eval.grid_prompts=4",
                                  "checkpoint.every=0")))
    la = _lora(tmp_path / "local2")
    for sync in syncs:  # the collective path: a gloo group of the trainer and workers
        run_stage(GRPORun(grpo_config(tmp_path / sync, tiny_export, *RAY, f"engine.weight_sync={sync}")))
        lb = _lora(tmp_path / sync)
        assert la.keys() == lb.keys()
        diff = max((la[k] - lb[k]).abs().max().item() for k in la)
        with capsys.disabled():
            print(f"\nsync, 2 workers, {sync} weight sync: LoRA after 2 iterations max |d| vs colocated {diff:.2e}")
        assert diff <= 1e-6, sync
        records = read_metrics(tmp_path / sync / "grpo" / "metrics.jsonl")
        assert [r["staleness_max"] for r in records] == [0, 0]
        assert not any("is_weight_mean" in r for r in records)
    return la


@pytest.mark.long  # make test keeps NFT on 2 ranks (test_forward_ranks.py) and the sync workers' equality above
@pytest.mark.parametrize("loss", ["nft", "awm", "dgpo"])
def test_forward_process_losses_on_two_workers_equal_the_colocated_run(loss, tiny_export, tmp_path, ray_cluster,
                                                                        capsys):
    """NFT samples with its old policy: the workers receive the old weights (swapped in when the packet is
    built), so 2 iterations on 2 sync workers end with the colocated run's adapter, bit for bit (both sample
    through the unmerged adapter: the trainer samples NFT's old weights in the policy itself)."""
    from tests.integration.test_forward_process import LOSSES, ODE

    args = (*ODE, LOSSES[loss], "train.threads=1", "eval.grid_prompts=4", "checkpoint.every=0", "perf.merge_lora=false")
    run_stage(GRPORun(grpo_config(tmp_path / "local", tiny_export, *args)))
    run_stage(GRPORun(grpo_config(tmp_path / "ray", tiny_export, *args, *RAY)))
    la, lb = _lora(tmp_path / "local"), _lora(tmp_path / "ray")
    ra, rb = ([r["reward_mean"] for r in read_metrics(tmp_path / run / "grpo" / "metrics.jsonl")] for run in ("local", "ray"))
    diff = max((la[k] - lb[k]).abs().max().item() for k in la)
    with capsys.disabled():
        print(f"\n{loss}, 2 sync workers vs colocated: rewards {ra} vs {rb}; LoRA max |d| {diff:.2e}")
    assert la.keys() == lb.keys() and ra == rb and len(ra) == 2
    assert diff == 0.0


@pytest.mark.long  # make test keeps the sync mode's equality with the colocated run and the worker replacement
@pytest.mark.parametrize("mode,k", [("one_step_off", 1), ("async", 2)])
def test_stale_modes_keep_staleness_within_bound_with_a_slow_worker(tiny_export, tmp_path, ray_cluster,
                                                                     monkeypatch, mode, k, capsys):
    monkeypatch.setenv("POSTTRAIN_SLOW_WORKER", "1:0.3")
    run = GRPORun(grpo_config(tmp_path / mode, tiny_export, *RAY, "train.steps=4", f"engine.mode={mode}",
                              "engine.max_staleness=2", "rollout.batch_size=4", "grpo.old_log_prob=recompute"))
    run_stage(run)
    records = read_metrics(tmp_path / mode / "grpo" / "metrics.jsonl")
    staleness = [r["staleness_max"] for r in records]
    with capsys.disabled():
        print(f"\n{mode}: staleness per iteration {staleness}, importance weight max "
              f"{[round(r.get('is_weight_max', 1.0), 4) for r in records]}, requests per worker "
              f"{[r['rollout_requests_per_worker'] for r in records]}")
    assert max(staleness) == k and all(s <= k for s in staleness), staleness
    assert staleness[0] == 0  # the first iteration is sampled by the initial weights
    stale = [r for r in records if r["staleness_max"] > 0]
    assert all(0 < r["is_weight_max"] <= 2.0 for r in stale)  # truncated at the default cap
    # the fast worker took more of the requests than the slow one in async mode
    if mode == "async":
        counts = [list(map(int, r["rollout_requests_per_worker"].split(","))) for r in records]
        assert sum(c[0] for c in counts) > sum(c[1] for c in counts), counts


@pytest.mark.parametrize("sync", ["object_store", pytest.param("collective", marks=pytest.mark.long)])
def test_a_worker_killed_mid_iteration_is_replaced_and_no_sample_is_lost(tiny_export, tmp_path, ray_cluster,
                                                                          monkeypatch, sync):
    monkeypatch.setenv("POSTTRAIN_SLOW_WORKER", "0:2.0")
    run = GRPORun(grpo_config(tmp_path / "kill", tiny_export, *RAY, "rollout.batch_size=4",
                              f"engine.weight_sync={sync}"))
    killed = threading.Event()

    def kill_when_busy():
        while run.engine.pool is None or not any(w == 0 for w, _ in list(run.engine.pool.busy.values())):
            time.sleep(0.05)
        time.sleep(0.5)  # inside worker 0's request
        run.engine.pool.kill(0)
        killed.set()

    threading.Thread(target=kill_when_busy, daemon=True).start()
    batch = run.engine.collect(0)
    assert killed.is_set()
    assert sorted(batch.traj.sample_ids.tolist()) == list(range(16))  # each once
    assert batch.metrics["worker_restarts"] == 1 and run.engine.pool.duplicates == 0
    assert torch.isfinite(batch.total).all()
    # a corrupted push is refused by the worker's checksum and reaches the trainer as an error
    packet = WeightPacket.build(run.st.policy.model, 1, lora=True)
    name = next(iter(packet.tensors))
    packet.tensors[name] = packet.tensors[name] + 1e-3
    run.engine.pool.publish(packet)
    run.engine._queue(1)
    with pytest.raises(WeightSyncError, match="checksum"):
        run.engine.collect(1)
    run.engine.close()
