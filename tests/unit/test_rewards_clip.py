"""clip_score, pickscore and aesthetic on a tiny random CLIPModel saved with save_pretrained and read
back through each reward's own loading code."""

import pytest
import torch

from rewards.aesthetic import AestheticMLP
from rewards.base import build_reward
from tests.unit.tiny_reward_models import assert_well_formed, save_tiny_clip, sample_images

pytestmark = pytest.mark.core

PROMPTS = ["a red apple", "rocket", "a cat in a hat"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip") / "clip", logit_scale=2.0)


def reference_logits(path, images, prompts):
    """exp(logit_scale) * cos(image_i, prompt_i) from CLIPModel's own forward (``logits_per_image``) on
    the processor's inputs: computed without the reward code."""
    from transformers import CLIPModel, CLIPProcessor

    from rewards.images import to_pil

    model = CLIPModel.from_pretrained(path).eval()
    proc = CLIPProcessor.from_pretrained(path)
    inputs = proc(text=prompts, images=to_pil(images), return_tensors="pt", padding=True)
    assert inputs["pixel_values"].shape[-2:] == (32, 32)  # the saved processor's crop, not a default
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal().float(), model.logit_scale.exp().item()


def test_clip_score_is_the_cosine(clip_dir):
    x = sample_images()
    reward = build_reward("clip_score", path=str(clip_dir))
    got = assert_well_formed(reward, x, PROMPTS, [reward.clip.model])
    logits, scale = reference_logits(clip_dir, x, PROMPTS)
    torch.testing.assert_close(got, logits / scale, rtol=1e-5, atol=1e-6)
    assert got.abs().max() <= 1 and got.std() > 0
    scaled = build_reward("clip_score", path=str(clip_dir), scale=2.5, clamp_zero=True)(x, PROMPTS)
    torch.testing.assert_close(scaled, 2.5 * (logits / scale).clamp(min=0), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reward(x, PROMPTS[::-1]), got)  # the prompt matters


def test_pickscore_is_logit_scale_times_cosine(clip_dir):
    x = sample_images()
    reward = build_reward("pickscore", path=str(clip_dir), processor_path=str(clip_dir))
    got = assert_well_formed(reward, x, PROMPTS, [reward.clip.model])
    logits, scale = reference_logits(clip_dir, x, PROMPTS)
    assert scale == pytest.approx(torch.tensor(2.0).exp().item())
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)


def test_clip_rewards_check_inputs(clip_dir, tmp_path):
    reward = build_reward("clip_score", path=str(clip_dir))
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(sample_images(), PROMPTS[:2])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(sample_images()[:, :1], PROMPTS)
    with pytest.raises(FileNotFoundError, match="CLIP folder not found"):
        build_reward("pickscore", path=str(tmp_path / "missing"))


def save_mlp(path, state):
    torch.save(state, path)
    return str(path)


def test_aesthetic_loads_the_released_layout_and_gives_a_known_value(clip_dir, tmp_path):
    # the keys and shapes of sac+logos+ava1-l14-linearMSE.pth, for an 8-d CLIP instead of 768-d
    shapes = {"layers.0": (1024, 8), "layers.2": (128, 1024), "layers.4": (64, 128), "layers.6": (16, 64),
              "layers.7": (1, 16)}
    state = {}
    for name, (o, i) in shapes.items():
        state[f"{name}.weight"] = torch.zeros(o, i)
        state[f"{name}.bias"] = torch.zeros(o)
    state["layers.7.bias"] = torch.tensor([5.5])
    reward = build_reward("aesthetic", weights=save_mlp(tmp_path / "a.pth", state), clip_path=str(clip_dir))
    got = assert_well_formed(reward, sample_images(), PROMPTS, [reward.clip.model, reward.mlp])
    assert torch.equal(got, torch.full((3,), 5.5))


def test_aesthetic_is_the_mlp_of_the_normalised_image_embedding(clip_dir, tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    from rewards.images import to_pil

    torch.manual_seed(3)
    state = AestheticMLP(8).state_dict()
    reward = build_reward("aesthetic", weights=save_mlp(tmp_path / "b.pth", state), clip_path=str(clip_dir))
    x = sample_images()
    got = assert_well_formed(reward, x, None, [reward.clip.model, reward.mlp])
    model, proc = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        out = model(**proc(text=PROMPTS, images=to_pil(x), return_tensors="pt", padding=True))
    h = out.image_embeds  # CLIPModel's forward returns L2-normalised projections
    torch.testing.assert_close(h.norm(dim=-1), torch.ones(3))
    for layer in (0, 2, 4, 6, 7):  # the released head is purely linear (dropout is off at eval)
        h = h @ state[f"layers.{layer}.weight"].T + state[f"layers.{layer}.bias"]
    torch.testing.assert_close(got, h.squeeze(-1), rtol=1e-5, atol=1e-6)
    assert got.std() > 0


def test_aesthetic_rejects_a_head_for_another_clip(clip_dir, tmp_path):
    path = save_mlp(tmp_path / "l14.pth", AestheticMLP(768).state_dict())
    with pytest.raises(ValueError, match="takes 768-d embeddings but the CLIP"):
        build_reward("aesthetic", weights=path, clip_path=str(clip_dir))
    bad = save_mlp(tmp_path / "bad.pth", {"fc.weight": torch.zeros(1, 8)})
    with pytest.raises(ValueError, match="not an aesthetic-predictor state dict"):
        build_reward("aesthetic", weights=bad, clip_path=str(clip_dir))
