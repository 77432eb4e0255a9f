"""Reading an original ImageReward checkpoint (``ImageReward.pt``, Xu et al. 2023) into transformers'
BLIP classes: the key renaming from BLIP's own ViT (``blip.visual_encoder.*``, timm-style names) to
``BlipVisionModel``; the text encoder (``blip.text_encoder.*``, BLIP's ``med.py`` BERT) already uses
``BlipTextModel``'s names; the reward head is ``mlp.layers.*``."""

from __future__ import annotations

import re

import torch

_VISION_RULES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.(fc[12])\.", r"encoder.layers.\1.mlp.\2."),
    (r"^norm\.", "post_layernorm."),
]

# Parts of BLIP_Pretrain that the score never uses (ImageReward loads its checkpoint with strict=False).
_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.itm_head.", "blip.temp",
           "blip.text_encoder.embeddings.position_ids")


def _rename_vision(key: str) -> str:
    for pattern, repl in _VISION_RULES:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise ValueError(f"imagereward: unexpected vision key 'blip.visual_encoder.{key}'")


def split_imagereward_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """An ``ImageReward.pt`` state dict -> (``BlipVisionModel`` state dict, ``BlipTextModel`` state dict,
    MLP state dict ``layers.*``). A leading ``module.`` is stripped; keys of unused parts are dropped.
    ``ValueError`` for a key that belongs to none of these."""
    vision, text, mlp = {}, {}, {}
    for key, value in state.items():
        key = key[len("module."):] if key.startswith("module.") else key
        if key.startswith(_UNUSED):
            continue
        if key.startswith("blip.visual_encoder."):
            vision[_rename_vision(key[len("blip.visual_encoder."):])] = value
        elif key.startswith("blip.text_encoder."):
            text[key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp."):
            mlp[key[len("mlp."):]] = value
        else:
            raise ValueError(f"imagereward: unexpected checkpoint key '{key}'")
    return vision, text, mlp


def med_to_text_config(med: dict, encoder_width: int) -> dict:
    """BLIP's ``med_config.json`` (a BERT config) -> ``BlipTextConfig`` keyword arguments; the
    cross-attention width is the vision width, as BLIP_Pretrain sets it."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    out = {k: med[k] for k in keys if k in med}
    out.update(encoder_hidden_size=encoder_width, is_decoder=True, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    return out
