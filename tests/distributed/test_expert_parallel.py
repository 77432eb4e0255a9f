"""Expert parallelism (``parallel.ep``, ``pretrain/parallel/expert.py``) on a tiny HiDream transformer (4 routed
experts, 2 active, in both blocks): EP = 2 on 2 ranks and EP = 2 x FSDP = 2 on 4 ranks equal one process on
the whole batch -- the forward with and without gradients (the rollout's path) within 1e-5, every
parameter's gradient within 1e-5 relative (routed experts, gate, shared expert, attention), the gradient
norm, and the weights after an optimizer step; each rank holds only its half of the routed experts."""

import pytest
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.grad_norm import clip_grad_norm_
from pretrain.parallel.launch import run_ranks
from pretrain.text_encoder import PromptEmbeds
from tests.distributed.common import full_grads, full_params
from tests.distributed.test_tensor_parallel import rel_diff

pytestmark = pytest.mark.core

T5_LEN, LLAMA_LEN = 6, 5


def hidream():
    """A tiny HiDream adapter (seed 0) and a batch of 4: latents [4, 4, 16, 16] (patch 8: 4 image tokens each)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImageTransformer2DModel

    from pretrain.models.hidream import HiDreamAdapter

    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=8, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_channels=[32, 24], text_emb_dim=32, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(128, 128), llama_layers=[0, 1])
    model = HiDreamAdapter(transformer, FlowMatchEulerDiscreteScheduler(shift=3.0), T5_LEN, 32, 24, 2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, 16, 16, generator=g)
    tokens = torch.randn(4, T5_LEN + 2 * LLAMA_LEN, 32, generator=g)
    tokens[:, T5_LEN:, 24:] = 0  # the Llama states are narrower (HiDreamPromptEncoder's zero padding)
    embeds = PromptEmbeds(tokens, torch.randn(4, 32, generator=g))
    return model, (x, torch.rand(4, generator=g), embeds), torch.randn(4, 4, 16, 16, generator=g)


def with_expert_lora(model):
    """Frozen base, LoRA r 4 on the attention's ``to_q`` and on every expert's ``w1`` / ``w2`` / ``w3`` (shared
    and routed), B random so every gradient is non-zero."""
    from peft import LoraConfig

    model.requires_grad_(False)
    torch.manual_seed(3)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                             target_modules=["to_q", "w1", "w2", "w3"]))
    g = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _ep_equals_one_process(rank, world, lora=False):
    mesh = ParallelDims(ep=2).build_mesh()  # dp_shard = world: EP 2 alone, or EP 2 x FSDP 2
    model, inputs, target = hidream()
    ref, _, _ = hidream()
    if lora:
        model, ref = with_expert_lora(model), with_expert_lora(ref)
    parallelize(model, mesh, ParallelConfig(activation_checkpointing=lora))  # the dispatch recomputed in backward
    per = 4 // world
    rows = slice(per * mesh.dp_rank, per * mesh.dp_rank + per)
    x, sigma, embeds = inputs
    with torch.no_grad():  # the rollout's path: diffusers' moe_infer in one process, the same dispatch here
        sampled, sampled_ref = model(x[rows], sigma[rows], embeds[rows]), ref.eval()(*inputs)[rows]
    ref.train()
    out, out_ref = model(x[rows], sigma[rows], embeds[rows]), ref(*inputs)
    (out - target[rows]).pow(2).mean().backward()
    (out_ref - target).pow(2).mean().backward()
    grads, want = full_grads(model), full_grads(ref)
    norm = float(clip_grad_norm_(list(model.parameters()), float("inf")))
    norm_ref = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1).step()
    params, params_ref = full_params(model), full_params(ref)
    experts = sorted({int(n.split("experts.")[1].split(".")[0]) for n in params if ".experts." in n})
    return dict(experts=experts, names=set(grads), all_names=set(want),
                missing=sorted(set(grads) - set(want)),
                out_diff=float((out - out_ref[rows]).abs().max()), out_max=float(out_ref.abs().max()),
                sampled_diff=float((sampled - sampled_ref).abs().max()),
                grad_rel=rel_diff(grads, {k: want[k] for k in grads}),
                norm=norm, norm_ref=norm_ref,
                param_diff=max(float((params[k] - params_ref[k]).abs().max()) for k in params),
                expert_grad_max=max(float(g.abs().max()) for k, g in grads.items() if ".experts." in k))


@pytest.mark.parametrize("world,lora", [(2, False), (2, True), pytest.param(4, False, marks=pytest.mark.long)])
def test_ep2_equals_one_process(world, lora, capsys):
    """Full fine-tuning, and LoRA on the routed experts too (their adapters live and train on the expert's rank)
    with activation checkpointing (backward recomputes each block, all-to-alls included)."""
    ranks = run_ranks(_ep_equals_one_process, lora, world_size=world)
    with capsys.disabled():
        for r in ranks:
            print(f"\nEP 2 on {world} ranks{' (LoRA)' if lora else ''}: experts {r['experts']}; "
                  f"output {r['out_diff']:.1e} (sampled "
                  f"{r['sampled_diff']:.1e}); gradients {r['grad_rel'][0]:.1e} relative (worst {r['grad_rel'][1]}); "
                  f"gradient norm {r['norm']:.6f} vs {r['norm_ref']:.6f}; weights after SGD {r['param_diff']:.1e}")
    # each EP rank holds its half of every layer's routed experts (4: two per rank), the rest is everywhere
    assert [r["experts"] for r in ranks] == [[0, 1], [2, 3]] * (world // 2)
    assert set().union(*(r["names"] for r in ranks)) == ranks[0]["all_names"] and not ranks[0]["missing"]
    assert lora == all("lora" in n for n in ranks[0]["all_names"])
    for r in ranks:
        assert r["out_diff"] <= 1e-5 * max(1.0, r["out_max"]) and r["sampled_diff"] <= 1e-5, r
        assert r["grad_rel"][0] <= 1e-5 and r["expert_grad_max"] > 0, r
        assert r["param_diff"] <= 1e-5, r
        assert abs(r["norm"] - r["norm_ref"]) <= 1e-5 * r["norm_ref"], r  # other ranks' experts counted once


def test_ep_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide dp_shard=4"):
        ParallelDims(ep=3).resolved(4)
    with pytest.raises(ValueError, match=r"parallel.ep=2 with parallel.tp=2: expert parallelism composes"):
        ParallelDims(ep=2, tp=2).resolved(4)
    assert ParallelDims(ep=2).resolved(4) == ParallelDims(1, 4, 1, 1, 1, 2)
    with pytest.raises(ValueError, match="reduce_dtype: 'fp16' with parallel.ep=2"):
        ParallelConfig(ep=2, reduce_dtype="fp16").validate("parallel.")
    assert "parallel.ep=2" in ParallelConfig(ep=2).untested_compile()  # a perf preset leaves compile off
    from pretrain.parallel.expert import local_range

    assert list(local_range(8, 4, 3)) == [6, 7]
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide the model's 4 routed experts"):
        local_range(4, 3, 0)


@pytest.fixture(scope="module")
def hidream_folder(tmp_path_factory):
    from tests.families.test_hidream import build_tiny_hidream

    return str(build_tiny_hidream(tmp_path_factory.mktemp("ep_hidream") / "pipeline"))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_a_grpo_iteration_under_ep2_equals_one_process(world, hidream_folder, tmp_path, capsys):
    """One LoRA GRPO iteration of the HiDream folder (``tests/distributed/test_layout_grpo.py``'s run: brightness
    reward, one optimizer step, LoRA on the attention and on every expert): EP 2 on 2 ranks, and EP 2 x FSDP 2
    on 4 (4 prompts, mini-batch 8), sample, score, checkpoint and export as one process does (the exported
    adapter holds both EP ranks' routed experts)."""
    from tests.distributed.test_layout_grpo import FAMILY, LORA_TOL, RATIO_TOL, REWARD_TOL, _grpo

    options = (*FAMILY["hidream"], "policy.target_modules=[to_q,to_k,to_v,w1,w2,w3]")
    if world == 4:
        options += ("rollout.prompts_per_step=4", "rollout.batch_size=8", "train.batch_size=8")
    ref = run_ranks(_grpo, hidream_folder, str(tmp_path / "one"), options, world_size=1)[0]
    ranks = run_ranks(_grpo, hidream_folder, str(tmp_path / "ep"), (*options, "parallel.ep=2"), world_size=world)
    d_reward = max((r["total"] - ref["total"]).abs().max().item() for r in ranks)
    lora, lora_ref = ranks[0]["lora"], ref["lora"]
    d_lora = max((lora[k] - lora_ref[k]).abs().max().item() for k in lora_ref)
    with capsys.disabled():
        print(f"\nHiDream GRPO, ep=2 on {world} ranks: {ranks[0]['layout']}\n  iteration 1 max |d reward| vs 1 process "
              f"{d_reward:.1e}; exported LoRA max |d| {d_lora:.1e}; first ratio {[r['ratio'] for r in ranks]}; "
              f"router load {ranks[0]['moe']} (one process {ref['moe']})")
    assert "ep 2" in ranks[0]["layout"] and ref["total"].std() > 0
    assert all(torch.equal(ranks[0]["total"], r["total"]) for r in ranks) and d_reward <= REWARD_TOL, d_reward
    for r in [ref, *ranks]:
        assert abs(r["ratio"][0] - 1) <= RATIO_TOL and abs(r["ratio"][1] - 1) <= RATIO_TOL, r["ratio"]
    assert set(lora) == set(lora_ref) and d_lora <= LORA_TOL
    assert {k.split("experts.")[1][0] for k in lora if ".experts." in k} == {"0", "1", "2", "3"}
    # the router's load, counted on each rank and summed, is the one process's
    assert set(ref["moe"]) == {"moe/load_max", "moe/load_min", "moe/idle_experts"} and ranks[0]["moe"] == ref["moe"]


def _grpo_resumed(rank, world, folder, run_dir, steps, overrides):
    """``steps`` GRPO iterations of the HiDream folder, resuming from the newest checkpoint of ``run_dir``;
    rank 0 returns the logged mean rewards."""
    from pathlib import Path

    from posttrain.grpo.stage import train
    from pretrain.runtime.metrics import read_metrics
    from tests.conftest import grpo_config
    from tests.distributed.test_layout_grpo import COMMON, REWARD

    cfg = grpo_config(run_dir, folder, *COMMON, *overrides, f"train.steps={steps}", "checkpoint.every=1",
                      "checkpoint.resume=true")
    cfg.rewards = {REWARD: 1.0}
    train(cfg)
    metrics = read_metrics(Path(run_dir) / "grpo" / "metrics.jsonl")
    return [r["reward_mean"] for r in metrics if "reward_mean" in r] if rank == 0 else None


@pytest.mark.long  # make test keeps the EP 2 iteration above and the sharded resume of test_checkpoint.py
def test_an_ep2_checkpoint_resumes_as_the_uninterrupted_run(hidream_folder, tmp_path, capsys):
    """Each EP rank writes its own experts into the DCP checkpoint; 2 iterations with a stop and a resume
    after the first equal one process's 2 uninterrupted iterations."""
    from tests.distributed.test_layout_grpo import FAMILY

    options = (*FAMILY["hidream"], "policy.target_modules=[to_q,w1,w2,w3]")
    ref = run_ranks(_grpo_resumed, hidream_folder, str(tmp_path / "one"), 2, options, world_size=1)[0]
    run_ranks(_grpo_resumed, hidream_folder, str(tmp_path / "ep"), 1, (*options, "parallel.ep=2"))
    resumed = run_ranks(_grpo_resumed, hidream_folder, str(tmp_path / "ep"), 2, (*options, "parallel.ep=2"))[0]
    with capsys.disabled():
        print(f"\nHiDream GRPO under ep=2, stopped after iteration 1 and resumed: mean rewards {resumed}; one "
              f"process uninterrupted {ref}")
    assert len(resumed) == len(ref) == 2 and ref[1] != ref[0]  # iteration 2 sees the update
    assert max(abs(a - b) for a, b in zip(resumed, ref)) <= 1e-6
