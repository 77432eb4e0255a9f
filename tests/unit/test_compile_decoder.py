"""perf.compile_decoder (opt-in): the rollout's VAE decoder compiled gives the eager decoder's images up
to float rounding; codecs without a VAE decoder are left alone."""

import pytest
import torch

from posttrain.grpo.perf import PerfConfig, compile_decoder, resolve_perf
from pretrain.codec import PatchifyCodec, VAECodec

pytestmark = pytest.mark.core


def _tiny_vae_codec() -> VAECodec:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, scaling_factor=1.5, shift_factor=0.1)
    return VAECodec(vae)


@pytest.mark.long  # make test keeps the compiled Wan blocks (test_wan.py)
def test_compiled_decoder_gives_the_eager_images():
    codec = _tiny_vae_codec()
    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    eager = codec.decode(latents)
    assert compile_decoder(codec) and codec.vae.decoder._compiled_call_impl is not None
    compiled = codec.decode(latents)
    assert compiled.shape == eager.shape == (3, 3, 16, 16) and eager.std() > 1e-3  # a non-trivial image
    assert (compiled - eager).abs().max() <= 1e-4


def test_other_codecs_stay_eager_and_the_option_is_opt_in():
    assert not compile_decoder(PatchifyCodec(2))
    assert not resolve_perf(PerfConfig(compile=True), "fp32", False).compile_decoder
    assert not resolve_perf(PerfConfig(preset="cpu"), "fp32", False).compile_decoder
    assert resolve_perf(PerfConfig(compile_decoder=True), "fp32", False).compile_decoder
