"""One GRPO iteration (LoRA) under tensor parallelism (TP = 2: SD3, FLUX, Wan, Qwen-Image) and diffusers'
context parallelism (CP = 2: FLUX, FLUX.2, Wan, Qwen-Image), against one process on the same seeds: both
ranks of a TP / CP group sample every prompt with the same noise, so iteration 1 sees the same rewards (up
to the rounding of split matmul sums), the first PPO ratio is 1 under every layout, and the exported adapters agree."""

import pytest
import torch
from safetensors.torch import load_file

from pretrain.parallel.launch import run_ranks
from tests.conftest import grpo_config

pytestmark = pytest.mark.long  # make test keeps TP and CP model equality (test_tensor_parallel, test_context_parallel)

REWARD = "tests.distributed.test_layout_grpo:brightness"
REWARD_TOL = 1e-6  # iteration-1 rewards vs one process; measured (printed) 0 to ~1e-7
RATIO_TOL = 1e-5
LORA_TOL = 1e-5  # exported adapter after one optimizer step at lr 3e-3
# optim.eps 1e-4: AdamW's first step is lr * g / (|g| + eps); with the default eps 1e-8 that is lr * sign(g)
# for all but the tiniest gradients, and a gradient of ~1e-8 that rounds differently under another layout
# moves its weight by up to lr, which measures Adam's conditioning rather than the layout.
COMMON = ("data.limit=4", "rollout.num_inference_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
          "rollout.batch_size=4", "train.batch_size=4", "train.steps=1", "optim.lr=3e-3", "optim.eps=1e-4",
          "eval.grid_prompts=2", "eval.num_inference_steps=2", "train.threads=1")
FAMILY = {
    "sd3": (),
    "flux": ("rollout.guidance_scale=1.0", "eval.guidance_scale=1.0", "model.options.image_size=32",
             "model.options.max_sequence_length=32"),
    "wan": ("model.options.num_frames=5", "model.options.image_size=16", "model.options.max_sequence_length=16",
            "rollout.guidance_scale=4.5", "eval.guidance_scale=4.5"),
    "qwenimage": ("model.options.image_size=32", "model.options.max_sequence_length=192", "rollout.guidance_scale=4.0",
                  "eval.guidance_scale=4.0"),
    "flux2": ("model.options.image_size=32", "model.options.max_sequence_length=64", "rollout.guidance_scale=4.0",
              "eval.guidance_scale=4.0"),
    "hidream": ("model.options.image_size=32", "model.options.max_sequence_length=16"),
}
LAYOUTS = [("sd3", "tp", 2), ("flux", "tp", 2), ("flux", "cp", 2), ("wan", "tp", 2), ("wan", "cp", 2),
           ("qwenimage", "tp", 2), ("qwenimage", "cp", 2), ("flux2", "cp", 2),
           ("sd3", "tp", 4), ("flux", "tp", 4), ("wan", "tp", 4), ("qwenimage", "tp", 4)]  # 4 ranks: TP 2 x FSDP 2


def brightness(images, prompts=None, metadata=None):
    """Mean pixel value float32 ``[B]`` of images ``[B, 3, H, W]`` or videos ``[B, F, 3, H, W]`` in [0, 1]."""
    return images.float().flatten(1).mean(1)


def _grpo(rank, world, folder, run_dir, overrides):
    from pathlib import Path

    import posttrain.grpo.stage as grpo
    from pretrain.runtime.loop import step_once

    cfg = grpo_config(run_dir, folder, *COMMON, *overrides)
    cfg.rewards = {REWARD: 1.0}
    run = grpo.GRPORun(cfg)
    totals, advantage = [], run.parts.advantage

    def keep(total, *args):
        totals.append(total.clone())
        return advantage(total, *args)

    run.parts.advantage = keep
    metrics = step_once(run)
    run.finish()
    lora = Path(run_dir) / "grpo" / "lora" / "pytorch_lora_weights.safetensors"
    return dict(total=totals[0], ratio=(metrics["ratio_min"], metrics["ratio_max"]), layout=run.ranks.describe(),
                moe={k: v for k, v in metrics.items() if k.startswith("moe/")},
                lora=load_file(str(lora)) if rank == 0 else None)


@pytest.fixture(scope="module")
def folders(tiny_export, tmp_path_factory):
    from tests.families.test_flux import save_tiny_flux
    from tests.families.test_flux2 import build_tiny_flux2
    from tests.families.test_qwenimage import build_tiny_qwenimage
    from tests.families.test_wan import build_tiny_wan

    root = tmp_path_factory.mktemp("layout_folders")
    return {"sd3": str(tiny_export), "flux": str(save_tiny_flux(root / "flux")),
            "wan": str(build_tiny_wan(root / "wan")), "qwenimage": str(build_tiny_qwenimage(root / "qwenimage")),
            "flux2": str(build_tiny_flux2(root / "flux2"))}


class _OneProcess(dict):
    """The one-process reference of a family, run the first time a test asks for it."""

    def __init__(self, folders, root):
        super().__init__()
        self.folders, self.root = folders, root

    def __missing__(self, family):
        self[family] = run_ranks(_grpo, self.folders[family], str(self.root / family), FAMILY[family], world_size=1)[0]
        return self[family]


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory):
    return _OneProcess(folders, tmp_path_factory.mktemp("layout_one"))


@pytest.mark.parametrize("family,layout,world", LAYOUTS)
def test_layout_grpo_iteration_matches_one_process(family, layout, world, folders, one_process, tmp_path, capsys):
    ref = one_process[family]
    ranks = run_ranks(_grpo, folders[family], str(tmp_path), (*FAMILY[family], f"parallel.{layout}=2"),
                      world_size=world)
    assert f"dp_shard {world // 2} x sp 1 x {layout} 2" in ranks[0]["layout"]
    assert ref["total"].std() > 0  # rewards with spread
    d_reward = max((r["total"] - ref["total"]).abs().max().item() for r in ranks)
    lora, lora_ref = ranks[0]["lora"], ref["lora"]
    assert set(lora) == set(lora_ref) and lora
    d_lora = max((lora[k] - lora_ref[k]).abs().max().item() for k in lora)
    moved = max(v.abs().max().item() for k, v in lora_ref.items() if "lora_B" in k)
    with capsys.disabled():
        print(f"\n{family} {layout}=2 on {world} ranks: iteration 1 max |d reward| vs 1 process {d_reward:.2e}; exported LoRA "
              f"max |d| {d_lora:.2e} (largest lora_B {moved:.2e}); first ratio {[r['ratio'] for r in ranks]}")
    for r in ranks[1:]:  # every rank advantages the gathered rewards; a TP / CP group samples alike
        assert torch.equal(ranks[0]["total"], r["total"])
    assert d_reward <= REWARD_TOL, d_reward
    for r in [ref, *ranks]:
        assert abs(r["ratio"][0] - 1) <= RATIO_TOL and abs(r["ratio"][1] - 1) <= RATIO_TOL, r["ratio"]
    assert d_lora <= LORA_TOL and moved > 10 * LORA_TOL  # the adapters trained: not a comparison of zeros
