"""Context parallelism with diffusers' plans (``pretrain/parallel/context.py``) for FLUX, FLUX.2, Wan and
Qwen-Image: CP = 2 on 2 ranks (FSDP2 over them, gradients summed) equals one process -- outputs within 1e-5, gradients
within 1e-5 relative, LoRA and full fine-tuning; and CP is refused for SD3, which has no plan."""

import pytest

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from tests.distributed.common import full_grads
from tests.distributed.test_tensor_parallel import FAMILIES, rel_diff, with_lora

pytestmark = pytest.mark.core


def _cp_equals_one_process(rank, world, family, lora):
    mesh = ParallelDims(dp_shard=1, cp=2).build_mesh()
    model, inputs, target = FAMILIES[family]()
    ref, _, _ = FAMILIES[family]()
    if lora:
        model, ref = with_lora(model), with_lora(ref)
    if family == "sd3":
        try:
            parallelize(model, mesh, ParallelConfig())
        except ValueError as e:
            return dict(error=str(e))
    parallelize(model, mesh, ParallelConfig())
    seen = []
    attn = next(m for m in model.blocks()[0].modules() if hasattr(m, "to_q"))  # after diffusers' split hooks
    attn.register_forward_pre_hook(lambda _m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).shape[1]),
                                    with_kwargs=True)
    out, out_ref = model(*inputs), ref(*inputs)
    (out - target).pow(2).mean().backward()
    (out_ref - target).pow(2).mean().backward()
    grads, want = full_grads(model), full_grads(ref)
    worst, name = rel_diff(grads, want)
    return dict(tokens=seen[0], out_diff=float((out - out_ref).abs().max().detach()),
                out_max=float(out_ref.abs().max().detach()), same_names=set(grads) == set(want),
                n_grads=len(want), grad_rel=worst, worst=name)


@pytest.mark.parametrize("family,tokens,lora", [  # half of 16 image / 32 video tokens; make test: Wan with LoRA
    pytest.param("wan", 16, True, id="lora-wan-16"),
    *(pytest.param(f, n, lora, id=f"{'lora' if lora else 'full'}-{f}-{n}", marks=pytest.mark.long)
      for f, n, lora in [("flux", 8, True), ("flux", 8, False), ("wan", 16, False), ("qwenimage", 8, True),
                         ("qwenimage", 8, False), ("flux2", 8, True), ("flux2", 8, False)])])
def test_cp2_equals_one_process(family, tokens, lora):
    for r in run_ranks(_cp_equals_one_process, family, lora):
        print(family, lora, r)
        assert r["tokens"] == tokens and r["same_names"] and r["n_grads"] > 0
        assert r["out_diff"] <= 1e-5 * max(1.0, r["out_max"]), r
        assert r["grad_rel"] <= 1e-5, r


def test_cp_refused_for_a_family_without_a_plan():
    for r in run_ranks(_cp_equals_one_process, "sd3", False):
        assert r["error"] == ("context parallel: SD3Transformer2DModel has no diffusers _cp_plan (FLUX, FLUX.2, Wan "
                              "and Qwen-Image have one; SD3 uses parallel.sp)")
