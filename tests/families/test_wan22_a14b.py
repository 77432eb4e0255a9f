"""Wan2.2 A14B (two experts: ``transformer`` above ``boundary_ratio * 1000``, ``transformer_2`` below)
against diffusers' ``WanPipeline`` on a tiny randomly initialised folder."""

import json
import shutil

import pytest
import torch

from pretrain.export import load_exported
from pretrain.sampling import initial_noise, sample_latents
from tests.conftest import grpo_config
from tests.families.test_wan import FRAMES, PROMPTS, build_tiny_wan, max_diff, pipeline_videos

pytestmark = pytest.mark.core

SIZE, STEPS, SCALE = 16, 6, 4.5
OPTIONS = {"num_frames": FRAMES, "image_size": SIZE, "max_sequence_length": 16}


def build_tiny_a14b(path, boundary_ratio: float):
    """The tiny Wan folder with a second transformer (other random weights) and ``boundary_ratio``."""
    from diffusers import WanPipeline, WanTransformer3DModel

    build_tiny_wan(path)
    pipe = WanPipeline.from_pretrained(path)
    torch.manual_seed(1)
    second = WanTransformer3DModel.from_config(pipe.transformer.config)
    WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, transformer=pipe.transformer,
                transformer_2=second, scheduler=pipe.scheduler, boundary_ratio=boundary_ratio).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory):
    return build_tiny_a14b(tmp_path_factory.mktemp("tiny_a14b") / "pipeline", 0.8)


def with_ratio(folder, tmp_path, ratio: float):
    """A copy of ``folder`` whose ``model_index.json`` has ``boundary_ratio`` ``ratio``."""
    out = tmp_path / f"ratio_{ratio}"
    shutil.copytree(folder, out)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": ratio}))
    return out


def expert_calls(*modules):
    """Forward pre-hooks appending each module's index to a list at every call; (list, handles)."""
    calls = []
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i)) for i, m in enumerate(modules)]
    return calls, handles


def test_expert_switch_step_and_samples_equal_the_pipeline_for_three_boundaries(a14b_folder, tmp_path, capsys):
    from diffusers import WanPipeline

    lines = []
    for ratio in (0.5, 0.8, 0.95):
        folder = with_ratio(a14b_folder, tmp_path, ratio)
        pipe = WanPipeline.from_pretrained(folder)
        model, encoder, codec, _ = load_exported(folder, options=OPTIONS)
        noise = initial_noise(1, codec.latent_shape(SIZE, SIZE), 0)
        want_calls, handles = expert_calls(pipe.transformer, pipe.transformer_2)
        want_latents, want_videos = pipeline_videos(pipe, PROMPTS[:1], noise, size=SIZE, steps=STEPS,
                                                    max_sequence_length=16)
        [h.remove() for h in handles]
        got_calls, handles = expert_calls(model.transformer.high, model.transformer.low)
        latents = sample_latents(model, encoder.encode(PROMPTS[:1]), encoder.encode([""]), noise, STEPS, SCALE, None)
        [h.remove() for h in handles]
        # the pipeline calls its expert twice a step (cond, uncond); ours once on the 2B batch
        want_steps, got_steps = want_calls[::2], got_calls
        assert got_steps == want_steps and model.experts(model.sigmas(STEPS)[:-1]).tolist() == got_steps
        assert 0 < want_steps.count(1) < STEPS  # both experts used
        d = max_diff(latents, want_latents)
        lines.append(f"ratio {ratio}: switch at step {want_steps.index(1)}, latents {d:.2e}")
        assert d <= 1e-5
        assert max_diff(codec.decode(latents), want_videos) <= 1e-5
    with capsys.disabled():
        print("\nwan2.2 a14b vs WanPipeline: " + "; ".join(lines))
    assert len({line.split(",")[0] for line in lines}) == 3


def test_rollout_records_the_experts_and_recomputation_uses_them(a14b_folder):
    from pretrain.data.dataset import EncodedSet
    from rollout.sampler import log_prob
    from tests.conftest import sampler_rollout
    from tests.families.lora_policy import perturbed_lora_policy

    model, encoder, codec, _ = load_exported(a14b_folder, options=OPTIONS)
    captions = PROMPTS + ["a face", "the flag"]
    prompts = EncodedSet(torch.zeros(4, 3, 16, 16, dtype=torch.uint8), captions, encoder.encode(captions))
    perturbed_lora_policy(model)
    assert sum("lora_B" in n for n, _ in model.transformer.high.named_parameters()) > 0
    assert sum("lora_B" in n for n, _ in model.transformer.low.named_parameters()) > 0
    traj = sampler_rollout(model.eval(), codec, prompts, [0, 1], group=2, batch=4, null=encoder.encode([""]),
                           sigmas=model.sigmas(STEPS), noise=0.7, scale=SCALE,
                           latent_shape=codec.latent_shape(SIZE, SIZE))
    experts = traj.settings.experts
    assert experts == tuple(model.experts(model.sigmas(STEPS)[:-1]).tolist()) and set(experts) == {0, 1}
    model.train()
    high, low = experts.index(0), experts.index(1)
    with torch.enable_grad():
        singles = [log_prob(model, traj, t).log_prob for t in (high, low)]
        both = log_prob(model, traj, [high, low]).log_prob  # one forward whose rows go to both experts
    ratio = torch.exp(torch.stack(singles, 1) - traj.log_probs[:, [high, low]])
    assert (ratio - 1).abs().max().item() <= 1e-5
    assert max_diff(both, torch.cat(singles)) <= 1e-5
    # a model that would route a transition elsewhere is refused, not recomputed with the wrong expert
    model.transformer.boundary_timestep = 1001.0  # every step to transition 2's expert
    with torch.no_grad():
        assert max_diff(log_prob(model, traj, low).log_prob, singles[1]) <= 1e-6
    with pytest.raises(ValueError, match="experts"):
        log_prob(model, traj, high)
    model.transformer.boundary_timestep = -1.0  # every step to the high-noise expert
    with pytest.raises(ValueError, match="experts"):
        log_prob(model, traj, [high, low])


def test_a14b_grpo_iteration_exports_both_experts_and_loras_that_load_in_diffusers(a14b_folder, tmp_path, capsys):
    from diffusers import WanPipeline

    from posttrain.grpo.stage import train
    from pretrain.models.wan import pipeline as wan
    from pretrain.runtime.metrics import read_metrics

    cfg = grpo_config(tmp_path, a14b_folder, f"model.options.num_frames={FRAMES}", f"model.options.image_size={SIZE}",
                      "model.options.max_sequence_length=16", "data.limit=4", "train.steps=1",
                      f"rollout.num_inference_steps={STEPS}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "rollout.batch_size=4", "train.batch_size=4", "rollout.guidance_scale=4.5",
                      "rewards.jpeg_compressibility=0", "rewards.test_video_brightness=1.0", "optim.lr=3e-2",
                      "eval.grid_prompts=2", "eval.num_inference_steps=2", "eval.guidance_scale=4.5")
    export = train(cfg)
    recs = read_metrics(tmp_path / "grpo/metrics.jsonl")
    assert abs(recs[0]["ratio_min"] - 1) <= 1e-5 and abs(recs[0]["ratio_max"] - 1) <= 1e-5
    assert (export / "transformer_2" / "config.json").is_file() and wan.check_folder(export)
    model, encoder, codec, _ = load_exported(export, options={"max_sequence_length": 16})
    noise = initial_noise(1, codec.latent_shape(SIZE, SIZE), 0)
    ours = codec.decode(sample_latents(model, encoder.encode(PROMPTS[:1]), encoder.encode([""]), noise, STEPS,
                                       SCALE, None))
    kw = dict(size=SIZE, steps=STEPS, max_sequence_length=16)
    d_export = max_diff(pipeline_videos(WanPipeline.from_pretrained(export), PROMPTS[:1], noise, **kw)[1], ours)
    with_lora = WanPipeline.from_pretrained(a14b_folder)
    with_lora.load_lora_weights(str(tmp_path / "grpo/lora"))
    with_lora.load_lora_weights(str(tmp_path / "grpo/lora/transformer_2"), load_into_transformer_2=True)
    d_lora = max_diff(pipeline_videos(with_lora, PROMPTS[:1], noise, **kw)[1], ours)
    base = WanPipeline.from_pretrained(a14b_folder)
    d_base = max_diff(pipeline_videos(base, PROMPTS[:1], noise, **kw)[1], ours)
    only_high = WanPipeline.from_pretrained(a14b_folder)
    only_high.load_lora_weights(str(tmp_path / "grpo/lora"))
    d_high = max_diff(pipeline_videos(only_high, PROMPTS[:1], noise, **kw)[1], ours)
    with capsys.disabled():
        print(f"\nwan2.2 a14b GRPO export vs WanPipeline {d_export:.2e}; base + both LoRAs {d_lora:.2e}; "
              f"base + the high-noise LoRA only {d_high:.2e}; base {d_base:.2e}")
    assert d_export <= 1e-5 and d_lora <= 1e-5
    assert d_base > 1e-4 and d_high > 1e-5  # both experts were trained


def test_half_an_a14b_folder_is_refused(a14b_folder, tmp_path):
    from pretrain.models.wan import pipeline as wan

    index = json.loads((a14b_folder / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(ValueError, match="boundary_ratio"):
        wan.check_folder(tmp_path)


@pytest.mark.long  # make test keeps FLUX under FSDP (test_family_fsdp.py)
def test_a14b_fsdp_on_two_ranks_equals_one_process(a14b_folder, tmp_path, capsys):
    """FSDP2 shards both experts' blocks: a GRPO iteration on 2 ranks sees the rewards of one process and
    exports the same adapters for both experts."""
    from safetensors.torch import load_file

    from pretrain.parallel.launch import run_ranks
    from tests.distributed.test_layout_grpo import FAMILY, _grpo

    runs = {}
    for world in (1, 2):
        overrides = (*FAMILY["wan"], f"rollout.num_inference_steps={STEPS}")
        out = run_ranks(_grpo, str(a14b_folder), str(tmp_path / f"w{world}"), overrides, world_size=world)
        lora = tmp_path / f"w{world}" / "grpo" / "lora"
        runs[world] = (out, *(load_file(str(p / "pytorch_lora_weights.safetensors"))
                              for p in (lora, lora / "transformer_2")))
    (one, *ref), (two, *got) = runs[1], runs[2]
    assert "dp_shard 2" in two[0]["layout"]
    assert all(abs(r["ratio"][0] - 1) <= 1e-5 and abs(r["ratio"][1] - 1) <= 1e-5 for r in [*one, *two])
    d_reward = max((r["total"] - one[0]["total"]).abs().max().item() for r in two)
    d_lora = max((g[k] - r[k]).abs().max().item() for g, r in zip(got, ref) for k in r)
    moved = min(max(v.abs().max().item() for k, v in r.items() if "lora_B" in k) for r in ref)
    with capsys.disabled():
        print(f"\nwan2.2 a14b FSDP 2 ranks vs 1 process: rewards {d_reward:.2e}, both experts' LoRA {d_lora:.2e} "
              f"(smallest expert's largest lora_B {moved:.2e})")
    assert all(set(g) == set(r) and r for g, r in zip(got, ref))
    assert d_reward <= 1e-6 and d_lora <= 1e-5 and moved > 1e-4


def test_a_built_sampler_records_the_experts_before_it_samples(a14b_folder):
    """A trainer whose rollouts come from workers compares their settings with its own sampler's, which
    has never sampled: the experts must be in them from the start."""
    from rollout.config import RolloutConfig
    from rollout.sampler import Sampler

    model, encoder, _, _ = load_exported(a14b_folder, options=OPTIONS)
    sampler = Sampler.build(RolloutConfig(num_inference_steps=STEPS, guidance_scale=SCALE), model, encoder, "cpu", None)
    assert sampler.settings.experts == tuple(model.experts(model.sigmas(STEPS)[:-1]).tolist())
    assert set(sampler.settings.experts) == {0, 1}


def test_real_wan22_a14b_config_loads(a14b_folder):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config
    from tests.conftest import ROOT

    cfg = load_config(GRPOConfig, ROOT / "configs/grpo/wan22_t2v_a14b.yaml", [f"model.pretrained={a14b_folder}"])
    assert cfg.model.options["num_frames"] == 33 and cfg.parallel.activation_checkpointing
    ro = cfg.rollout
    assert (ro.num_inference_steps, ro.timestep_fraction, ro.guidance_scale) == (16, 0.6, 4.0)
    assert iteration_shape(cfg)[0] == cfg.rollout.prompts_per_step * cfg.rollout.group_size == 32
