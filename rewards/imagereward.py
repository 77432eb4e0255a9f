"""``imagereward``: ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human
Preferences for Text-to-Image Generation", arXiv 2304.05977): a BLIP ViT-L/16 image encoder, BLIP's
BERT text encoder cross-attending to the image, and an MLP on the [CLS] state, standardised with the
training reward mean/std. Rebuilt on transformers' ``BlipVisionModel`` / ``BlipTextModel`` (the
``image-reward`` package cannot be installed beside this project's timm and transformers), loading
the original ``ImageReward.pt`` through ``rewards.imagereward_convert``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rewards.aesthetic import AestheticMLP
from rewards.base import register
from rewards.images import check_images, freeze, to_pil
from rewards.imagereward_convert import med_to_text_config, split_imagereward_state_dict
from pretrain.truncation import TruncationCounter, hf_token_counts

# ImageReward v1.0: BLIP's med_config.json (bert-base + 2 added tokens) and BLIP's 'large' ViT.
MED_CONFIG = {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "max_position_embeddings": 512, "hidden_act": "gelu",
              "layer_norm_eps": 1e-12, "pad_token_id": 0}
VIT_LARGE = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
             "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6}
REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def blip_tokenizer(path: str):
    """BLIP's tokenizer: the BERT tokenizer in local folder ``path`` (bert-base-uncased for the released
    model) plus ``[DEC]`` as bos and ``[ENC]`` as an additional special token (ids 30522, 30523)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"imagereward: tokenizer folder not found: {path}")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def _load_state(checkpoint: str) -> dict:
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"imagereward: checkpoint not found: {checkpoint}")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


def _strict_load(module: torch.nn.Module, state: dict, part: str, checkpoint: str) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"imagereward: the {part} in {checkpoint} does not match the configured "
                         f"architecture: {str(e).splitlines()[0]} ...") from e


@register("imagereward")
class ImageReward:
    """score_i = (MLP(text_encoder(prompt_i, image_i)[CLS]) − 0.16717) / 1.03334: float32 ``[B]``,
    a standardised preference score (about −2 .. 2 on generated images; higher = preferred).

    Args: ``checkpoint``: ``ImageReward.pt`` (state dict of the original ``ImageReward`` module);
    ``tokenizer_path``: a local bert-base-uncased tokenizer folder; ``med_config``: BLIP's
    ``med_config.json`` (default: its released values, so no download); ``vision_config``: overrides
    of the ViT-L/16 settings (``BlipVisionConfig`` names: hidden_size, num_hidden_layers,
    num_attention_heads, intermediate_size, image_size, patch_size); ``device``; ``max_length`` of
    the prompt tokens (35 with [CLS] and [SEP], as released; longer prompts are cut, and counted per
    call in ``truncation``, a :class:`pretrain.truncation.TruncationCounter`). Images: bicubic resize +
    centre crop to ``image_size`` and CLIP mean/std, as ImageReward's own transform.
    ``FileNotFoundError`` for a missing file; ``ValueError`` when the checkpoint does not fit the
    configured architecture."""

    def __init__(self, checkpoint: str, tokenizer_path: str, med_config: str | None = None,
                 vision_config: dict | None = None, device: str = "cpu", max_length: int = 35):
        from torchvision import transforms as T
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        vcfg = {**VIT_LARGE, **(vision_config or {})}
        med = json.loads(Path(med_config).read_text()) if med_config else MED_CONFIG
        vision_sd, text_sd, mlp_sd = split_imagereward_state_dict(_load_state(checkpoint))
        self.device = torch.device(device)
        vision = BlipVisionModel(BlipVisionConfig(**vcfg))
        text = BlipTextModel(BlipTextConfig(**med_to_text_config(med, vcfg["hidden_size"])), add_pooling_layer=False)
        mlp = AestheticMLP(text.config.hidden_size)
        for module, sd, part in ((vision, vision_sd, "vision encoder"), (text, text_sd, "text encoder"),
                                 (mlp, mlp_sd, "reward MLP")):
            _strict_load(module, sd, part, checkpoint)
        self.vision, self.text, self.mlp = (freeze(m, self.device) for m in (vision, text, mlp))
        self.tokenizer = blip_tokenizer(tokenizer_path)
        self.max_length = max_length
        self.truncation = TruncationCounter("imagereward", max_length)
        size = vcfg["image_size"]
        self.preprocess = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size),
                                     T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "imagereward")
        pixels = torch.stack([self.preprocess(im) for im in to_pil(images)]).to(self.device)
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        self.truncation.check(prompts, hf_token_counts(self.tokenizer, prompts))
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        out = self.text(input_ids=tok.input_ids, attention_mask=tok.attention_mask, encoder_hidden_states=image_embeds,
                        encoder_attention_mask=image_atts, is_decoder=False)
        reward = self.mlp(out.last_hidden_state[:, 0, :].float()).squeeze(-1)
        return ((reward - REWARD_MEAN) / REWARD_STD).float().cpu()
