"""LoRA on a Ray rollout worker stays bound and in precision over weight syncs (issue 48), fp32 (the tiny
export, sampled through the LoRA-merged copy) and bf16 (a tiny SD3 pipeline loaded with
``model.options.dtype=bfloat16``: a bf16 base and bf16 adapters, sampled under bf16 autocast). One
worker receives the trainer's initial adapter (lora_B = 0), then 10 packets of a perturbed adapter,
alternately through the object store and the collective gloo group. After every sync, on a fixed
(x, sigma, prompt embedding):

- the worker's velocity (:meth:`RolloutWorker.probe`: the module it samples with) equals the trainer's
  policy's within the precision's tolerance, relative to max |v|, and the difference does not grow
  (last <= 2 x first + tol);
- the worker wraps as many modules with LoRA as the trainer, more than zero; with lora_B = 0 its velocity
  is the base model's (exactly: the adapter adds B A x = 0), with lora_B != 0 it differs from the base
  model's by more than 10 x the tolerance (the worker samples with the adapter, not the base);
- its frozen base weights are bitwise the trainer's, so bitwise what the first load gave (no in-place
  merge / unmerge of the adapter into them, which would round bf16 weights), and stay in the precision's
  dtype."""

import pytest
import torch

from tests.conftest import require_extra

pytestmark = pytest.mark.core

ray = require_extra("ray", "ray")

from posttrain.base.stage import PolicyStage  # noqa: E402
from posttrain.grpo.engines.weight_sync import WeightGroup, WeightPacket, checksum, frozen_tensors  # noqa: E402
from posttrain.grpo.engines.worker import RolloutWorker  # noqa: E402
from posttrain.grpo.perf import resolve_perf  # noqa: E402
from pretrain.runtime.precision import Precision  # noqa: E402
from tests.conftest import grpo_config  # noqa: E402

SYNCS = 10  # perturbed syncs
# max |v_worker - v_trainer| / max |v|. fp32: the merged copy's W + s B A against peft's W x + s B (A x), float
# rounding (~4e-7 measured). bf16: worker and trainer run the same bf16 ops (peft's, no merged copy), so they
# may differ only where an accumulation order rounds a value to the neighbouring bf16 number: one spacing, at
# most 2 x 2^-8 relative to the largest |v| (8 significant bits, unit roundoff 2^-8; measured: 0, bitwise
# equal). A stale or missing adapter moves v by 0.1 or more; a bf16 base rounded by an in-place merge / unmerge
# after each sync drifted from 6e-3 to 1.5e-2 over the 10 syncs, and the base checksum catches it at the first.
TOL = {"fp32": 1e-5, "bf16": 2 * 2.0 ** -8}
# precision -> (export fixture, overrides, dtype of the frozen base, std of the seeded delta added to every adapter
# tensor before each sync: the adapter moves v by 0.1 to 1 x max |v| over the syncs on either model)
CASES = {
    "fp32": ("tiny_export", (), "torch.float32", 0.05),
    "bf16": ("sd3_folder", ("model.options.dtype=bfloat16", "model.options.max_sequence_length=32", "data.limit=4",
                            "train.precision=bf16"), "torch.bfloat16", 0.15),
}


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory):
    from tests.families.test_sd3 import save_tiny_sd3

    return save_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipe")


def _perturb(policy, k: int, std: float) -> None:
    """Add a delta drawn from N(0, std^2), seeded by ``k``, to every adapter tensor (in its own dtype)."""
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for _, p in policy.model.named_parameters():
            if p.requires_grad:
                p.add_((std * torch.randn(p.shape, generator=g)).to(p.dtype))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# make test keeps bf16 (peft's adapters on the worker); fp32 (the merged copy) also syncs in
# test_rollout_workers.py's equality with the colocated run
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.long), "bf16"])
def test_worker_lora_matches_the_trainer_after_every_sync(precision, request, tmp_path, ray_cluster, capsys):
    fixture, overrides, base_dtype, std = CASES[precision]
    tol = TOL[precision]
    cfg = grpo_config(tmp_path, request.getfixturevalue(fixture), "engine.name=ray", "engine.workers=1",
                      "train.threads=1", *overrides)
    perf = resolve_perf(cfg.perf, cfg.train.precision, False, True)
    assert perf.merge_lora == (precision == "fp32")  # fp32 workers sample with the merged copy, bf16 with peft's
    # started first: the worker loads the export while the trainer does
    worker = ray.remote(RolloutWorker).options(num_cpus=cfg.engine.num_cpus).remote(cfg, perf, False, 0)
    st = PolicyStage.setup(cfg, "grpo")  # the trainer's policy, as a GRPO run builds it
    policy, prec = st.policy, Precision(cfg.train.precision, st.device)
    size = st.meta["image_size"]
    x = torch.randn(2, *st.codec.latent_shape(size, size), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    embeds = st.train_set.batch([0, 1])[1]

    def trainer_velocity(reference: bool = False) -> torch.Tensor:
        with torch.no_grad(), prec.autocast():
            if reference:
                with policy.reference() as ref:
                    return ref.eval()(x, sigma, embeds).float()
            return policy.model.eval()(x, sigma, embeds).float()

    base_sum = checksum(frozen_tensors(policy.model))
    host = ray.util.get_node_ip_address()
    store, port = WeightGroup.host_store(host, 2)
    join = worker.join_weights.remote(host, port, 1, 2, "gloo", 1)
    group = WeightGroup(host, port, 0, 2, "gloo", 1, store=store)
    try:
        assert ray.get(join) == 1

        def sync(version: int, mode: str) -> dict:
            packet = WeightPacket.build(policy.model, version, lora=True)
            if mode == "object_store":  # what a request's packet argument does: load() of the stored object
                held = ray.get(worker.load.remote(ray.put(packet)))
            else:  # what WorkerPool._sync_collective does
                ref = worker.receive.remote(WeightGroup.meta(packet))
                group.broadcast(packet)
                held = ray.get(ref)
            got = ray.get(worker.probe.remote(x, sigma, embeds))
            assert held == got["version"] == version
            assert got["velocity"].dtype == torch.float32 and got["velocity"].shape == x.shape
            assert got["lora_modules"] == policy.lora_modules() > 0
            assert got["base_checksum"] == base_sum and got["base_dtypes"] == [base_dtype]
            return got

        # the initial adapter: lora_B = 0, so the trainer, the worker and the base model agree exactly
        assert all(not p.any() for n, p in policy.model.named_parameters() if "lora_B" in n)
        base = trainer_velocity(reference=True)
        first = sync(0, "object_store")
        assert torch.equal(trainer_velocity(), base) and torch.equal(first["velocity"], base)
        diffs, moved, modes = [], [], []
        for k in range(1, SYNCS + 1):
            _perturb(policy, k, std)
            modes.append(("object_store", "collective")[k % 2])
            got = sync(k, modes[-1])
            diffs.append(_rel(got["velocity"], trainer_velocity()))
            moved.append(_rel(got["velocity"], base))
        assert checksum(frozen_tensors(policy.model)) == base_sum  # the trainer's base did not move either
    finally:
        ray.kill(worker, no_restart=True)
    with capsys.disabled():
        print(f"\n{precision} worker LoRA over {SYNCS} syncs ({'/'.join(dict.fromkeys(modes))} alternately), "
              f"max |v_worker - v_trainer| / max |v|: {[f'{d:.2e}' for d in diffs]} (tol {tol:.1e}); "
              f"worker vs base model: {[f'{m:.2e}' for m in moved]}; {policy.lora_modules()} LoRA modules")
    assert max(diffs) <= tol, diffs
    assert diffs[-1] <= 2 * diffs[0] + tol, diffs  # no drift over syncs
    assert min(moved) > 10 * tol, moved  # the worker samples with the adapter
