"""The tiny SD3 setup of ``configs/bench/flowgrpo_tiny_sd3.yaml``, built offline with random weights and
saved through the real formats: a CLIP text encoder + tokenizer folder (205 tokens x 64, pooled 64), an
``AutoencoderKL`` folder (16 latent channels, factor 8), an export of the ``SD3Transformer2DModel`` and
a captioned image folder of 64 OpenMoji emoji at 256 px. Costs do not depend on the weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.codec import CodecConfig
from pretrain.export import META, export_model
from pretrain.models import ModelConfig
from pretrain.models.sd3 import build_transformer
from pretrain.text_encoder import TextEncoderConfig

TEXT_TOKENS, TEXT_DIM, IMAGE_SIZE, LATENT_CHANNELS = 205, 64, 256, 16


def _bytes_to_unicode() -> list[str]:
    """The byte-level alphabet of CLIP's BPE (printable bytes map to themselves, others to 256 + i)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def build_text_encoder(root: Path) -> None:
    """A character-level CLIP tokenizer (no merges) and a 2-layer ``CLIPTextModelWithProjection``."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    tok.save_pretrained(tok_dir)
    cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=TEXT_DIM, intermediate_size=4 * TEXT_DIM,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TEXT_TOKENS,
                         projection_dim=TEXT_DIM, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    CLIPTextModelWithProjection(cfg).save_pretrained(root / "text_encoder", safe_serialization=True)


def build_vae(root: Path) -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                        sample_size=IMAGE_SIZE, scaling_factor=1.5305, shift_factor=0.0609)
    vae.save_pretrained(root / "vae", safe_serialization=True)


def build_data(root: Path, n: int = 64) -> None:
    from PIL import Image

    from pretrain.data.emoji import list_emoji, render_emoji

    records = list_emoji()[0][:n]
    images = render_emoji([r.text for r in records], IMAGE_SIZE)
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (r, img) in enumerate(zip(records, images)):
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(root / f"{i:03d}.png")
        lines.append(json.dumps({"file": f"{i:03d}.png", "caption": r.caption}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")


def build_assets(model: ModelConfig, export_dir: str | Path, data_dir: str | Path) -> None:
    """Build everything once (skipped when ``export_dir`` already holds an export)."""
    export_dir, data_dir = Path(export_dir), Path(data_dir)
    if (export_dir / META).is_file() and (data_dir / "captions.jsonl").is_file():
        return
    parts = export_dir.parent / "parts"
    build_text_encoder(parts)
    build_vae(parts)
    build_data(data_dir)
    torch.manual_seed(0)
    latent = IMAGE_SIZE // 8
    transformer = build_transformer(ModelConfig(preset="tiny", overrides=dict(model.overrides)), latent,
                                    LATENT_CHANNELS, TEXT_DIM, TEXT_DIM)
    export_model(transformer, export_dir,
                 TextEncoderConfig(name="clip_folder", max_length=TEXT_TOKENS, path=str(parts)),
                 CodecConfig(name="vae", path=str(parts)), IMAGE_SIZE, {"shift": 3.0})
