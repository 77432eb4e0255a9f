"""Emulated FP8 training end to end on the tiny preset: 50 pretraining steps track bf16's losses, the
export loads back as a plain diffusers model; GRPO's first ratio is 1 and DPO's first loss ln 2, with
LoRA and with full fine-tuning (policy, rollout and reference run the same converted layers)."""

import json
import math

import pytest
import torch

from posttrain.dpo.stage import train as dpo_train
from posttrain.grpo.stage import train as grpo_train
from pretrain.runtime.metrics import read_metrics
from pretrain.trainer import train
from tests.conftest import dpo_config, grpo_config, require_extra, tiny_config

pytestmark = pytest.mark.core

require_extra("torchao", "lowp")
FP8 = ["train.low_precision.recipe=fp8_rowwise", "train.low_precision.emulate=true"]


@pytest.mark.long  # make test keeps the FP8 ratio, loss and resume checks below
def test_fifty_emulated_fp8_pretraining_steps_track_bf16(tmp_path):
    runs = {}
    for name, extra in (("bf16", []), ("fp8", FP8)):
        export = train(tiny_config(tmp_path / name, "train.steps=50", "eval.every=0", "train.precision=bf16", *extra))
        runs[name] = [r["loss"] for r in read_metrics(tmp_path / name / "pretrain/metrics.jsonl") if "loss" in r]
        assert len(runs[name]) == 50 and all(torch.isfinite(torch.tensor(runs[name])))
    first = sum(runs["bf16"][:10]) / 10
    last = {k: sum(v[-10:]) / 10 for k, v in runs.items()}
    gap = abs(last["fp8"] / last["bf16"] - 1)
    print(f"\n50 steps, mean loss of the last 10: bf16 {last['bf16']:.4f}, FP8 row-wise (emulated) {last['fp8']:.4f} "
          f"(rel {gap:.3f}); first 10 of bf16 {first:.4f}")
    assert last["bf16"] < 0.9 * first and gap < 0.03  # both learn; FP8 within 3 % of bf16
    # the export holds plain Linear weights: diffusers loads it without torchao
    from diffusers import SD3Transformer2DModel

    loaded = SD3Transformer2DModel.from_pretrained(export)
    assert type(loaded.transformer_blocks[0].attn.to_q) is torch.nn.Linear
    assert json.loads((export / "posttrain.json").read_text())


@pytest.mark.parametrize("lora_rank", [8, 0])  # LoRA (frozen FP8 base, fp32 adapters) and full fine-tuning
def test_grpo_first_ratio_is_one_with_emulated_fp8(tiny_export, tmp_path, lora_rank):
    # one optimizer step per iteration: the ratio is measured before any update
    grpo_train(grpo_config(tmp_path, tiny_export, "train.steps=1", "train.batch_size=16",
                           f"policy.lora_rank={lora_rank}", *FP8))
    rec = read_metrics(tmp_path / "grpo/metrics.jsonl")[0]
    print(f"\nGRPO (lora_rank {lora_rank}), emulated FP8: first ratio in [{rec['ratio_min']:.8f}, "
          f"{rec['ratio_max']:.8f}], kl {rec['kl']:.2e}")
    assert abs(rec["ratio_min"] - 1) <= 1e-5 and abs(rec["ratio_max"] - 1) <= 1e-5
    assert abs(rec["kl"]) <= 1e-8  # the reference (adapters off / the frozen copy) runs the same FP8 layers


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_dpo_first_loss_is_log_two_with_emulated_fp8(tiny_export, tmp_path, lora_rank):
    # before any update the policy equals its reference: every implicit reward margin is 0, loss = ln 2
    dpo_train(dpo_config(tmp_path, tiny_export, "train.steps=1", "online.resample_every=1", f"policy.lora_rank={lora_rank}",
                         *FP8))
    rec = read_metrics(tmp_path / "dpo/metrics.jsonl")[0]
    assert rec["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_mxfp8_resume_is_bitwise_and_the_export_is_plain(tmp_path):
    from safetensors.torch import load_file

    mx = ["eval.every=0", "checkpoint.every=2", "train.low_precision.recipe=mxfp8", "train.low_precision.emulate=true"]
    whole = train(tiny_config(tmp_path / "whole", "train.steps=4", *mx))
    train(tiny_config(tmp_path / "cut", "train.steps=2", *mx))
    resumed = train(tiny_config(tmp_path / "cut", "train.steps=4", "checkpoint.resume=true", *mx))
    a, b = (load_file(str(p / "diffusion_pytorch_model.safetensors")) for p in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in a.values())
