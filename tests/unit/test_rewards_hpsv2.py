"""hpsv2 on a tiny random OpenCLIP model (a custom model-config JSON) saved as HPS checkpoints are
(``torch.save({'state_dict': ...})``) and read back through the reward's own loading code."""

import json

import pytest
import torch

from rewards.base import build_reward
from tests.unit.tiny_reward_models import assert_well_formed, sample_images

pytestmark = pytest.mark.core

PROMPTS = ["a red apple", "rocket", "a cat in a hat"]
TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    import open_clip

    d = tmp_path_factory.mktemp("hps")
    cfg = d / "tiny-hps-test.json"
    cfg.write_text(json.dumps(TINY))
    open_clip.add_model_config(cfg)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps-test").eval()
    torch.save({"state_dict": model.state_dict()}, d / "HPS_v2_compressed.pt")
    return d / "HPS_v2_compressed.pt", cfg, model


def test_hpsv2_is_the_cosine_of_the_normalised_openclip_embeddings(hps_files):
    import open_clip
    from torchvision import transforms as T

    from rewards.images import to_pil

    ckpt, cfg, model = hps_files
    reward = build_reward("hpsv2", checkpoint=str(ckpt), model_config=str(cfg))
    x = sample_images()
    got = assert_well_formed(reward, x, PROMPTS, [reward.model])
    # by hand: the validation transform written out, the in-memory model that was saved
    pre = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                     T.Normalize(open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)])
    pixels = torch.stack([pre(im) for im in to_pil(x)])
    with torch.no_grad():
        img = model.encode_image(pixels, normalize=True)
        txt = model.encode_text(open_clip.tokenize(PROMPTS), normalize=True)
    torch.testing.assert_close(got, (img * txt).sum(-1), rtol=1e-5, atol=1e-6)
    assert got.abs().max() <= 1 and got.std() > 0
    assert not torch.allclose(reward(x, PROMPTS[::-1]), got)


def test_hpsv2_errors(hps_files, tmp_path):
    ckpt, cfg, _ = hps_files
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        build_reward("hpsv2", checkpoint=str(tmp_path / "none.pt"), model_config=str(cfg))
    with pytest.raises(ValueError, match="one prompt per image"):
        build_reward("hpsv2", checkpoint=str(ckpt), model_config=str(cfg))(sample_images(), PROMPTS[:1])
