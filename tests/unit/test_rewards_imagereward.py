"""imagereward on tiny random BLIP encoders (transformers' BlipVisionModel / BlipTextModel) written out
in the original ImageReward.pt layout (BLIP's own ViT key names, ``blip.``/``mlp.`` prefixes, plus the
unused projection heads) and read back through the reward's own loading code."""

import json
import re

import pytest
import torch

from rewards.aesthetic import AestheticMLP
from rewards.base import build_reward
from rewards.imagereward import REWARD_MEAN, REWARD_STD
from tests.unit.tiny_reward_models import assert_well_formed, bert_tokenizer_dir, sample_images

pytestmark = pytest.mark.core

PROMPTS = ["a red apple", "rocket", "a cat in a hat"]
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=16, layer_norm_eps=1e-6)
MED = {"architectures": ["BertModel"], "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
       "num_attention_heads": 2, "vocab_size": 30524, "max_position_embeddings": 64, "hidden_act": "gelu",
       "layer_norm_eps": 1e-12, "pad_token_id": 0, "type_vocab_size": 2, "encoder_width": 768,
       "add_cross_attention": True}

# transformers' BlipVisionModel names -> BLIP's vit.py names (as in ImageReward.pt)
TO_ORIGINAL = [(r"^embeddings\.class_embedding$", "cls_token"), (r"^embeddings\.position_embedding$", "pos_embed"),
               (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
               (r"^encoder\.layers\.(\d+)\.layer_norm([12])\.", r"blocks.\1.norm\2."),
               (r"^encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"blocks.\1.attn.qkv."),
               (r"^encoder\.layers\.(\d+)\.self_attn\.projection\.", r"blocks.\1.attn.proj."),
               (r"^encoder\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."), (r"^post_layernorm\.", "norm.")]


def original_key(key):
    for pattern, repl in TO_ORIGINAL:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise AssertionError(key)


def tiny_parts(seed=0):
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(**VISION)).eval()
    text = BlipTextModel(BlipTextConfig(vocab_size=30524, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64, encoder_hidden_size=32,
                                        is_decoder=True), add_pooling_layer=False).eval()
    mlp = AestheticMLP(24).eval()
    with torch.no_grad():  # larger than the default init, so the image and the prompt move the score visibly
        for p in [*vision.parameters(), *text.parameters()]:
            if p.ndim >= 2:
                p.normal_(0, 0.2)
        for layer in mlp.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.bias.zero_()
    return vision, text, mlp


def save_checkpoint(path, vision, text, mlp):
    state = {f"blip.visual_encoder.{original_key(k)}": v for k, v in vision.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.{k}": v for k, v in mlp.state_dict().items()})
    state.update({"blip.vision_proj.weight": torch.zeros(256, 32), "blip.text_proj.weight": torch.zeros(256, 24),
                  "blip.text_encoder.embeddings.position_ids": torch.arange(64)[None]})  # unused by the score
    torch.save(state, path)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("imagereward")
    (d / "med_config.json").write_text(json.dumps(MED))
    parts = tiny_parts()
    return save_checkpoint(d / "ImageReward.pt", *parts), str(d / "med_config.json"), parts


def load(ckpt, med):
    return build_reward("imagereward", checkpoint=ckpt, tokenizer_path=bert_tokenizer_dir(), med_config=med,
                        vision_config=VISION)


def test_imagereward_score_by_hand(files):
    from torchvision import transforms as T
    from transformers import AutoTokenizer

    from rewards.images import to_pil

    ckpt, med, (vision, text, mlp) = files
    reward = load(ckpt, med)
    x = sample_images()
    got = assert_well_formed(reward, x, PROMPTS, [reward.vision, reward.text, reward.mlp])
    tok = AutoTokenizer.from_pretrained(bert_tokenizer_dir())
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    assert len(tok) == 30524 and tok.convert_tokens_to_ids("[ENC]") == 30523
    ids = tok(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    pre = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                     T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    with torch.no_grad():
        img = vision(pixel_values=torch.stack([pre(im) for im in to_pil(x)])).last_hidden_state
        cls = text(input_ids=ids.input_ids, attention_mask=ids.attention_mask, encoder_hidden_states=img,
                   encoder_attention_mask=torch.ones(img.shape[:2], dtype=torch.long)).last_hidden_state[:, 0]
        want = (mlp(cls).squeeze(-1) - REWARD_MEAN) / REWARD_STD
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.std() > 0
    plain = torch.stack([torch.zeros(3, 40, 48), torch.ones(3, 40, 48), x[0]])
    by_image = reward(plain, PROMPTS[:1] * 3)              # one prompt, three images: the image matters
    by_prompt = reward(x[[0, 0, 0]], PROMPTS)             # one image, three prompts: the prompt matters
    assert by_image.std() > 0.1 * by_image.abs().mean() and by_prompt.std() > 0.1 * by_prompt.abs().mean()


def test_imagereward_known_head_gives_the_standardised_bias(files, tmp_path):
    ckpt, med, (vision, text, _) = files
    mlp = AestheticMLP(24)
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp.layers[-1].bias.fill_(2.0)
    reward = load(save_checkpoint(tmp_path / "k.pt", vision, text, mlp), med)
    torch.testing.assert_close(reward(sample_images(), PROMPTS),
                               torch.full((3,), (2.0 - 0.16717362830052426) / 1.0333394966054072))


def test_imagereward_rejects_foreign_checkpoints(files, tmp_path):
    ckpt, med, _ = files
    state = torch.load(ckpt)
    torch.save({**state, "blip.itm_head.weight": torch.zeros(2, 24), "head.weight": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="unexpected checkpoint key 'head.weight'"):
        load(str(tmp_path / "x.pt"), med)
    with pytest.raises(ValueError, match="the vision encoder in .* does not match"):
        build_reward("imagereward", checkpoint=ckpt, tokenizer_path=bert_tokenizer_dir(), med_config=med,
                     vision_config={**VISION, "num_hidden_layers": 3})
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load(str(tmp_path / "none.pt"), med)
