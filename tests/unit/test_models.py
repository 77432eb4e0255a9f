import pytest
import torch

from pretrain.codec import PatchifyCodec
from pretrain.export import ExportMeta, export_model, load_exported
from pretrain.models import ModelConfig, count_parameters
from pretrain.models.sd3 import SD3Adapter, build_transformer
from pretrain.text_encoder import PromptEmbeds, TextEncoderConfig
from pretrain.codec import CodecConfig

pytestmark = pytest.mark.core


def _embeds(b, g):
    return PromptEmbeds(torch.randn(b, 24, 384, generator=g), torch.randn(b, 384, generator=g))


def test_tiny_preset_is_under_a_million_parameters():
    m = build_transformer(ModelConfig(preset="tiny"), 32, 3, 384, 384)
    assert count_parameters(m) < 1_000_000


def test_adapter_passes_sigma_times_1000_as_timestep():
    torch.manual_seed(0)
    m = build_transformer(ModelConfig(preset="tiny"), 16, 3, 384, 384).eval()
    g = torch.Generator().manual_seed(1)
    x, e, sigma = torch.randn(2, 3, 16, 16, generator=g), _embeds(2, g), torch.tensor([0.3, 0.9])
    direct = m(hidden_states=x, encoder_hidden_states=e.tokens, pooled_projections=e.pooled,
               timestep=torch.tensor([300.0, 900.0]), return_dict=False)[0]
    torch.testing.assert_close(SD3Adapter(m)(x, sigma, e), direct, rtol=0, atol=0)


def test_saved_and_loaded_tiny_model_gives_identical_outputs(tmp_path):
    torch.manual_seed(0)
    m = build_transformer(ModelConfig(preset="tiny"), 16, 3, 384, 384).eval()
    out = export_model(m, tmp_path / "export", ExportMeta(TextEncoderConfig(), CodecConfig(), 16,
                       {"num_inference_steps": 4, "guidance_scale": 2.0, "shift": 1.0}))
    adapter, encoder, codec, meta = load_exported(out)
    g = torch.Generator().manual_seed(2)
    x, e, sigma = torch.randn(3, 3, 16, 16, generator=g), _embeds(3, g), torch.tensor([1.0, 0.5, 0.01])
    with torch.no_grad():
        assert torch.equal(SD3Adapter(m)(x, sigma, e), adapter.eval()(x, sigma, e))
    assert meta["image_size"] == 16 and codec.channels == 3
    # the diffusers class loads the export directly
    from diffusers import SD3Transformer2DModel

    assert SD3Transformer2DModel.from_pretrained(out).config.num_layers == 2


def test_patchify_codec_roundtrip():
    img = torch.rand(2, 3, 8, 8)
    for f in (1, 2):
        c = PatchifyCodec(f)
        z = c.encode(img)
        assert z.shape == (2, 3 * f * f, 8 // f, 8 // f) and z.min() >= -1 and z.max() <= 1
        torch.testing.assert_close(c.decode(z), img)


def test_video_patchify_frame_code_roundtrips_and_marks_absolute_time():
    from pretrain.codec import VideoPatchifyCodec, build_codec

    videos = torch.rand(2, 4, 3, 8, 8)
    plain, coded = VideoPatchifyCodec(2, 4), build_codec(CodecConfig(name="video_patchify", factor=2, frames=4,
                                                                      frame_code=True))
    z = coded.encode(videos)
    assert coded.channels == 13 and z.shape == (2, 13, 4, 4, 4) == (2, *coded.latent_shape(8, 8))
    torch.testing.assert_close(z[:, :12], plain.encode(videos))
    # the last channel is the frame index, -1 .. 1, constant over each frame
    torch.testing.assert_close(z[:, 12], torch.tensor([-1, -1 / 3, 1 / 3, 1]).view(1, 4, 1, 1).expand(2, 4, 4, 4))
    torch.testing.assert_close(coded.decode(z), videos)
    # reversing time reverses the pixel channels but not the code: a clip and its reverse are told apart
    z_rev = coded.encode(videos.flip(1))
    torch.testing.assert_close(z_rev[:, :12], z[:, :12].flip(2))
    assert torch.equal(z_rev[:, 12], z[:, 12]) and not torch.equal(z_rev[:, 12], z[:, 12].flip(1))


def test_exported_video_codec_keeps_its_frame_code(tmp_path):
    from pretrain.models.wan import build_wan_transformer

    codec_cfg = CodecConfig(name="video_patchify", factor=2, frames=4, frame_code=True)
    out = export_model(build_wan_transformer("tiny", {}, 13, 384), tmp_path / "export",
                       ExportMeta(TextEncoderConfig(), codec_cfg, 16,
                                  {"shift": 1.0, "num_inference_steps": 4, "guidance_scale": 1.0}, arch="wan"))
    _, _, codec, meta = load_exported(out)
    assert meta["codec"]["frame_code"] is True and codec.latent_shape(16, 16) == (13, 4, 8, 8)
