"""Ulysses sequence parallelism (our plan, SP = 2) and diffusers' context parallelism (CP = 2) on the
tiny Wan video transformer equal one process: outputs, gradients, and the log-probs of a video rollout
recomputed under SP / CP (the GRPO ratio == 1 invariant)."""

import pytest
import torch

from pretrain.codec import VideoPatchifyCodec
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from pretrain.parallel.sequence import enable_sequence_parallel
from pretrain.schedule import sigma_schedule
from pretrain.text_encoder import PromptEmbeds
from tests.distributed.common import full_grads

pytestmark = pytest.mark.long  # make test keeps image SP (test_sequence_parallel) and Wan CP (test_context_parallel)

FRAMES, SIZE, TEXT_DIM, STEPS, NOISE, SCALE = 4, 16, 32, 4, 0.7, 2.0


def tiny_video_model(seed: int = 0):
    from pretrain.models.wan import WanVideoAdapter, build_wan_transformer

    torch.manual_seed(seed)  # codec factor 2: 12 channels; 4 frames x 4 x 4 patches = 64 tokens
    return WanVideoAdapter(build_wan_transformer("tiny", {}, 12, TEXT_DIM))


def _layout(mesh_dims, model):
    """Install SP (our Ulysses plan) or nothing (CP is installed by ``parallelize``) on ``model``."""
    mesh = mesh_dims.build_mesh() if isinstance(mesh_dims, ParallelDims) else mesh_dims
    if mesh.dims.sp > 1:
        enable_sequence_parallel(model, mesh.sp_group)
    return mesh


def _video_sp(rank, world, layout):
    from rollout.config import RolloutConfig
    from rollout.sampler import Sampler, log_prob

    ref, model = tiny_video_model(), tiny_video_model()
    mesh = _layout(ParallelDims(dp_shard=1, **{layout: 2}), model)
    parallelize(model, mesh, ParallelConfig())  # (CP, then) FSDP over the 2 ranks, gradients summed over them
    seen = []
    model.transformer.blocks[0].attn1.register_forward_pre_hook(
        lambda _m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).shape[1]), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, FRAMES, 8, 8, generator=g)
    sigma = torch.rand(2, generator=g)
    embeds = PromptEmbeds(torch.randn(2, 5, TEXT_DIM, generator=g), torch.zeros(2, 0))
    target = torch.randn(2, 12, FRAMES, 8, 8, generator=g)
    out, out_ref = model(x, sigma, embeds), ref(x, sigma, embeds)
    (out - target).pow(2).mean().backward()
    (out_ref - target).pow(2).mean().backward()
    grads, grads_ref = full_grads(model), full_grads(ref)
    result = dict(tokens_per_rank=seen[0], out_diff=float((out - out_ref).abs().max()),
                  out_max=float(out_ref.abs().max()), same_grad_names=set(grads) == set(grads_ref),
                  grad_diff=max(float((grads[k] - grads_ref[k]).abs().max()) for k in grads),
                  grad_max=max(float(g.abs().max()) for g in grads_ref.values()))
    # a video rollout sampled without SP, its log-probs recomputed with SP = 2 (and without, in train mode)
    null = PromptEmbeds(torch.zeros(1, 5, TEXT_DIM), torch.zeros(1, 0))
    with torch.no_grad():
        sampler = Sampler(RolloutConfig(noise_level=NOISE, guidance_scale=SCALE), sigma_schedule(STEPS, 3.0), null)
        traj = sampler.sample(ref.eval(), VideoPatchifyCodec(2, FRAMES), embeds, ["a", "b"],
                              group_ids=torch.tensor([0, 0]), sample_ids=[0, 1], latent_shape=(12, FRAMES, 8, 8),
                              seed=0, iteration=0, device="cpu")
        lp_sp = torch.stack([log_prob(model.train(), traj, t).log_prob for t in range(STEPS)], 1)
        lp_one = torch.stack([log_prob(ref.train(), traj, t).log_prob for t in range(STEPS)], 1)
    result.update(images=tuple(traj.images.shape), lp_sp_diff=float((lp_sp - traj.log_probs).abs().max()),
                  lp_one_diff=float((lp_one - traj.log_probs).abs().max()),
                  lp_finite=bool(torch.isfinite(traj.log_probs).all()))
    errors = {}
    odd = tiny_video_model()
    _layout(mesh, odd)
    if layout == "cp":
        from pretrain.parallel.context import enable_context_parallel

        enable_context_parallel(odd, mesh.cp_mesh)
    try:
        odd(torch.randn(1, 12, 3, 2, 2), sigma[:1], embeds[:1])  # 3 frames x 1 x 1 patches = 3 tokens
    except ValueError as e:
        errors["tokens"] = str(e)
    return result, errors


@pytest.fixture(scope="module", params=["sp", "cp"])
def results(request):
    return request.param, run_ranks(_video_sp, request.param)


def test_video_sp2_outputs_gradients_and_log_probs_equal_sp1(results):
    for result, _ in results[1]:
        print(result)
        assert result["tokens_per_rank"] == 32  # 64 video tokens split over 2 ranks
        assert result["images"] == (2, FRAMES, 3, SIZE, SIZE) and result["lp_finite"]
        assert result["out_max"] > 0.1 and result["grad_max"] > 1e-3 and result["same_grad_names"]
        assert result["out_diff"] <= 1e-5 and result["grad_diff"] <= 1e-5
        assert result["lp_sp_diff"] <= 1e-5 and result["lp_one_diff"] <= 1e-5


def test_video_sp_degree_must_divide_the_tokens(results):
    want = {"sp": "sequence parallel: sp=2 does not divide the 3 video tokens",
            "cp": "context parallel: parallel.cp=2 does not divide the tokens of an input WanTransformer3DModel's "
                  "plan splits (hidden_states [1, 12, 3, 2, 2], timestep [1], encoder_hidden_states [1, 5, 32])"}
    for _, errors in results[1]:
        assert errors["tokens"] == want[results[0]]
