"""LoRA under FSDP2 on 2 ranks: a bf16 base with fp32 adapters trains; the adapter and the full weights
gathered from the shards load in one process, element for element."""

import copy

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from pretrain.models.sd3 import SD3_ATTENTION
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.export import save_full_pretrained, save_lora_adapter
from pretrain.parallel.fsdp import parallelize
from tests.distributed.common import flow_loss, full_params, tiny_batch, tiny_model
from pretrain.parallel.launch import run_ranks

pytestmark = pytest.mark.core

LORA_FILE = "pytorch_lora_weights.safetensors"


def _with_lora(model, rank_r: int = 3, seed: int = 0):
    """Frozen base + trainable LoRA of rank ``rank_r`` (3: uneven shards over 2 ranks) with random B."""
    model.requires_grad_(False)
    model.transformer.add_adapter(LoraConfig(r=rank_r, lora_alpha=6, init_lora_weights="gaussian",
                                             target_modules=list(SD3_ATTENTION)))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _train(model, rank, steps, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    x, sigma, embeds, v = tiny_batch(4)
    mine = slice(2 * rank, 2 * rank + 2)
    losses = []
    for _ in range(steps):
        loss = flow_loss(model, x[mine], sigma[mine], embeds[mine], v[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _bf16_base_fp32_lora(rank, mesh):
    model = _with_lora(tiny_model())  # fp32; parallelize stores the frozen base in bf16
    before = {k: v if "lora_" in k else v.to(torch.bfloat16) for k, v in full_params(model).items()}
    parallelize(model, mesh, ParallelConfig(param_dtype="bf16"))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    losses = _train(model, rank, 3)
    after = full_params(model)
    lora = [k for k in after if "lora_" in k]
    base = [k for k in after if "lora_" not in k]
    return dict(losses=losses, n_lora=len(lora),
                lora_dtypes={dtypes[k] for k in lora}, base_dtypes={dtypes[k] for k in base},
                lora_changed=[float((after[k] - before[k]).abs().max()) for k in lora],
                base_unchanged=all(torch.equal(after[k], before[k]) for k in base))


def _adapter_roundtrip(rank, mesh, out):
    model = _with_lora(tiny_model())
    reference_dir = out / "unsharded_lora"
    if rank == 0:  # the key set an unsharded model writes
        copy.deepcopy(model).transformer.save_lora_adapter(str(reference_dir), safe_serialization=True)
    parallelize(model, mesh, ParallelConfig())
    _train(model, rank, 2)  # shards now differ from the initial values
    expected = {k: v for k, v in full_params(model).items() if "lora_" in k}
    save_lora_adapter(model, out / "sharded_lora")
    return expected


def _full_export(rank, mesh, out):
    model, frozen = tiny_model(), tiny_model().requires_grad_(False)  # full fine-tuning + its reference
    parallelize(model, mesh, ParallelConfig())
    parallelize(frozen, mesh, ParallelConfig())
    x, sigma, embeds, _ = tiny_batch(2)
    with torch.no_grad():
        ref_diff = float((frozen(x, sigma, embeds) - tiny_model()(x, sigma, embeds)).abs().max())
    _train(model, rank, 1)
    expected = {k.removeprefix("transformer."): v for k, v in full_params(model).items()}
    save_full_pretrained(model, out / "full")
    return dict(expected=expected, ref_diff=ref_diff)


def _scenarios(rank, world, out):
    mesh = ParallelDims().build_mesh()
    return dict(bf16=_bf16_base_fp32_lora(rank, mesh), lora=_adapter_roundtrip(rank, mesh, out),
                full=_full_export(rank, mesh, out))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_export")
    return out, run_ranks(_scenarios, out)


def test_bf16_base_fp32_lora_shards_and_trains(results):
    r = results[1][0]["bf16"]
    print(r)
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert r["lora_dtypes"] == {torch.float32} and r["base_dtypes"] == {torch.bfloat16}
    assert r["n_lora"] == 2 * (8 + 7)  # A and B of 8 projections per block; the last block has no to_add_out
    # AdamW moves every adapter weight by about lr = 1e-2, except the last block's add_q_proj (its text
    # queries feed only the discarded text output, so no gradient)
    assert sum(c > 5e-3 for c in r["lora_changed"]) == r["n_lora"] - 2
    assert r["base_unchanged"]


def test_lora_adapter_from_two_shards_loads_in_one_process(results):
    out, ranks = results
    expected = ranks[0]["lora"]
    assert set(load_file(out / "sharded_lora" / LORA_FILE)) == set(load_file(out / "unsharded_lora" / LORA_FILE))
    model = tiny_model(seed=123)
    model.transformer.load_lora_adapter(str(out / "sharded_lora"), weight_name=LORA_FILE, prefix=None,
                                        adapter_name="default")
    loaded = {k: p for k, p in model.named_parameters() if "lora_" in k}
    assert set(loaded) == set(expected) and len(expected) > 0
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


def test_full_weights_from_two_shards_load_in_one_process(results):
    from diffusers import SD3Transformer2DModel

    out, ranks = results
    expected = ranks[0]["full"]["expected"]
    loaded = SD3Transformer2DModel.from_pretrained(out / "full")
    assert set(loaded.state_dict()) == set(tiny_model().transformer.state_dict())  # params + pos_embed buffer
    assert set(dict(loaded.named_parameters())) == set(expected)
    for k, v in loaded.named_parameters():
        assert torch.equal(v, expected[k]), k
    assert ranks[0]["full"]["ref_diff"] == 0.0  # the sharded frozen reference computes what the plain one does
