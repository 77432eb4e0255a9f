"""Low-precision training with torchao: each format's round-trip error on a tiny DiT's weights against the
closed form for its mantissa width, the module filter's exact list of unconverted layers, validation
errors naming the key, and one converted training step against the high-precision one."""

import math

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.runtime.low_precision import DIT_KEEP, LowPrecisionConfig, convert, plan
from tests.conftest import ROOT, require_extra
from tests.distributed.common import flow_loss, tiny_batch, tiny_model

pytestmark = pytest.mark.core

require_extra("torchao", "lowp")


def _snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


def _rounding_snr_db(mantissa_bits: int) -> float:
    """Round-to-nearest with m stored mantissa bits: relative error uniform in +/- 2^-(m+1), so
    SNR = 10 log10(3 * 4^(m+1)) dB (a lower bound: values high in their binade err less)."""
    return 10 * math.log10(3 * 4 ** (mantissa_bits + 1))


def _round_trips(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    def fp8(granularity, axis=None):
        t = hp_tensor_to_float8_dynamic(w, torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=granularity,
                                        axiswise_dim=axis)
        return t.to_original_precision().float()

    return {"bf16": w.bfloat16().float(), "fp8_tensorwise": fp8(ScalingGranularity.TENSORWISE),
            "fp8_rowwise": fp8(ScalingGranularity.AXISWISE, -1),
            # the training recipe's RCEIL scales (the default FLOOR saturates each block's largest value)
            "mxfp8": MXTensor.to_mx(w, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL
                                    ).dequantize(torch.float32),
            "nvfp4": NVFP4Tensor.to_nvfp4(w.bfloat16()).dequantize(torch.float32)}


# stored mantissa bits: bf16 7, e4m3 3 (FP8, MXFP8), e2m1 1 (NVFP4)
MANTISSA = {"bf16": 7, "fp8_tensorwise": 3, "fp8_rowwise": 3, "mxfp8": 3, "nvfp4": 1}


def test_each_format_round_trips_the_dit_weights_at_its_mantissa_width():
    model = tiny_model()
    names, _ = plan(model.transformer, LowPrecisionConfig(recipe="fp8_rowwise"))
    w = torch.cat([model.transformer.get_submodule(n).weight.detach().flatten() for n in names]).view(-1, 64)
    snr = {k: _snr_db(w, v) for k, v in _round_trips(w).items()}
    for fmt, m in MANTISSA.items():
        assert _rounding_snr_db(m) <= snr[fmt] <= _rounding_snr_db(m) + 5, (fmt, snr[fmt], _rounding_snr_db(m))
    assert snr["bf16"] > snr["fp8_rowwise"] + 20 > snr["nvfp4"] + 20


def test_the_module_filter_keeps_exactly_the_dit_defaults_and_small_layers():
    model = tiny_model()
    converted, kept = plan(model.transformer, LowPrecisionConfig(recipe="fp8_rowwise"))
    per_block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_k_proj", "attn.add_v_proj", "attn.add_q_proj",
                 "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                 "ff_context.net.2"]
    blocks = len(model.transformer.transformer_blocks)
    last = [n for n in per_block if n not in ("attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")]
    # SD3's last block is context_pre_only: no text-stream output projection or feed-forward
    assert converted == [f"transformer_blocks.{b}.{n}" for b in range(blocks) for n in
                         (per_block if b < blocks - 1 else last)]
    assert sorted(kept) == sorted(
        ["time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
         "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "context_embedder",
         "norm_out.linear", "proj_out"]
        + [f"transformer_blocks.{b}.{n}" for b in range(blocks) for n in ("norm1.linear", "norm1_context.linear")])
    assert kept["proj_out"] == "matches keep pattern 'proj_out'"
    # MXFP8 needs multiples of 32, NVFP4 of 128: the 64-wide tiny layers are kept for NVFP4 only
    assert plan(model.transformer, LowPrecisionConfig(recipe="mxfp8"))[0] == converted
    nv_converted, nv_kept = plan(model.transformer, LowPrecisionConfig(recipe="nvfp4"))
    assert nv_converted == [] and nv_kept["transformer_blocks.0.ff.net.2"] == "features 256 -> 64 not multiples of 128"


def test_lora_adapters_stay_high_precision_and_their_frozen_base_is_converted():
    from peft import LoraConfig

    model = tiny_model()
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"]))
    names = convert(model.transformer, LowPrecisionConfig(recipe="fp8_rowwise", emulate=True))
    q = model.transformer.transformer_blocks[0].attn.to_q
    assert "transformer_blocks.0.attn.to_q.base_layer" in names
    assert type(q.base_layer).__name__ == "Float8Linear" and type(q.lora_A["default"]) is torch.nn.Linear
    assert not any("lora_" in n for n in names) and all(p.dtype == torch.float32 for p in model.parameters())
    assert DIT_KEEP[-2:] == ("*.lora_A.*", "*.lora_B.*")


@pytest.mark.parametrize("recipe,tol", [("fp8_rowwise", 0.05), ("fp8_tensorwise", 0.05), ("mxfp8", 0.05)])
def test_an_emulated_step_tracks_the_high_precision_step(recipe, tol):
    # the same model and batch: loss and gradients within the format's rounding (3 mantissa bits: ~6 %);
    # 32 samples: MXFP8's weight gradient needs the token count (32 x 5 text tokens) in blocks of 32
    ref, low = tiny_model(), tiny_model()
    convert(low.transformer, LowPrecisionConfig(recipe=recipe, emulate=True))
    batch = tiny_batch(32)
    losses = [flow_loss(m, *batch) for m in (ref, low)]
    for loss in losses:
        loss.backward()
    assert [n for n, p in low.named_parameters() if p.grad is None] == []  # biases of converted layers too
    assert abs(losses[1].item() / losses[0].item() - 1) < tol / 5
    g_ref, g_low = (m.transformer.transformer_blocks[0].attn.to_q.weight.grad.flatten() for m in (ref, low))
    assert float(torch.cosine_similarity(g_ref, g_low, dim=0)) > 1 - tol


def test_validation_names_the_key(tmp_path):
    from pretrain.trainer import PretrainConfig

    cfg = ROOT / "configs/pretrain/emoji_tiny.yaml"
    cases = [("train.low_precision.recipe=fp4", "train.low_precision.recipe: 'fp4' is not one of"),
             ("train.low_precision.fp8_all_gather=true", "train.low_precision.fp8_all_gather: needs recipe "
                                                         "fp8_tensorwise"),
             ("train.low_precision.recipe=nvfp4 train.low_precision.emulate=true",
              "train.low_precision.emulate: torchao has no emulation of NVFP4 training")]
    if not torch.cuda.is_available():
        cases.append(("train.low_precision.recipe=fp8_rowwise", "train.low_precision.recipe: fp8_rowwise needs an "
                                                                "NVIDIA GPU of compute capability 8.9+"))
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
            load_config(PretrainConfig, cfg, overrides.split())
    ok = load_config(PretrainConfig, cfg, ["train.low_precision.recipe=mxfp8", "train.low_precision.emulate=true"])
    assert ok.train.low_precision.keep == list(DIT_KEEP)
