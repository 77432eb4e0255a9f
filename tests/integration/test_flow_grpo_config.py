"""flow_grpo's SD3.5-M PickScore recipe as a posttrain config (configs/grpo/flow_grpo_pickscore_sd35.yaml,
mapped in docs/flow_grpo.md): it loads, its iteration is flow_grpo's epoch (48 prompts x 24 images, 4
mini-batches, 2 optimizer steps), and on a tiny StableDiffusion3Pipeline folder its policy binds the
LoRA to every attention projection it names."""

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.core

CONFIG = ROOT / "configs/grpo/flow_grpo_pickscore_sd35.yaml"


def test_the_flow_grpo_recipe_loads_with_flow_grpo_s_epoch(tmp_path):
    from posttrain.grpo.stage import GRPOConfig, iteration_shape
    from pretrain.config import load_config

    cfg = load_config(GRPOConfig, CONFIG, ["model.pretrained=/models/sd35m", "data.path=configs/prompts/openmoji",
                                           "rewards.pickscore.path=/models/pickscore"])
    assert iteration_shape(cfg) == (1152, 4, 2)  # samples per epoch, mini-batches, optimizer steps
    ro, loss = cfg.rollout, cfg.grpo.loss
    assert (ro.num_inference_steps, ro.noise_level, ro.guidance_scale, ro.group_size) == (10, 0.7, 4.5, 24)
    assert (loss["clip_range"], loss["beta"], cfg.optim.lr, cfg.train.batch_size // 32) == (1e-4, 0.04, 3e-4, 9)


def test_the_recipe_s_policy_binds_on_a_tiny_sd3_folder(tmp_path):
    from posttrain.grpo.stage import GRPOConfig, GRPORun
    from pretrain.config import load_config
    from tests.families.test_sd3 import save_tiny_sd3

    folder = save_tiny_sd3(tmp_path / "sd3")
    cfg = load_config(GRPOConfig, CONFIG, [
        f"model.pretrained={folder}", f"run_dir={tmp_path / 'run'}", "data.path=configs/prompts/openmoji",
        "~rewards.pickscore", "rewards.jpeg_compressibility=1.0", "model.options={image_size: 32}",
        "train.precision=fp32", "parallel.param_dtype=fp32", "perf.preset=none", "train.device=cpu",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4", "train.batch_size=4",
        "train.grad_accum=1", "train.ema_decay=0"])
    run = GRPORun(cfg)
    blocks = len(run.st.model.transformer.transformer_blocks)
    # 4 joint projections + 4 context projections per block, the last block's context output excepted
    assert run.st.policy.lora_modules() >= 7 * blocks
    run.engine.close()
