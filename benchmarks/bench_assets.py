"""The SD3 setups of the GRPO benchmarks, built offline with random weights and saved through the real
formats: a CLIP text encoder + tokenizer folder, an ``AutoencoderKL`` folder (16 latent channels, factor
8), an export of the ``SD3Transformer2DModel`` and a captioned image folder of 64 OpenMoji emoji. Costs do
not depend on the weights. :data:`TINY` is ``configs/bench/flowgrpo_tiny_sd3.yaml``'s (205 tokens x 64,
pooled 64, 256 px through a 16-32 channel VAE); :data:`SD3_MEDIUM` has SD3.5-Medium's conditioning and
image shapes (333 tokens x 4096, pooled 2048, 512 px through SD3's 128-512 channel VAE), its text encoder
one layer deep (the transformer's inputs have the real shapes; the encoder runs once per prompt)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.codec import CodecConfig
from pretrain.export import META, ExportMeta, export_model
from pretrain.models import ModelConfig
from pretrain.models.sd3 import build_transformer
from pretrain.text_encoder import TextEncoderConfig

LATENT_CHANNELS = 16


@dataclass(frozen=True)
class AssetShape:
    """Text tokens and width (``text_dim`` per token, ``pooled_dim`` pooled), text encoder layers, image
    side in pixels, the VAE's ``block_out_channels`` and ``layers_per_block``."""

    text_tokens: int
    text_dim: int
    pooled_dim: int
    text_layers: int
    image_size: int
    vae_channels: tuple[int, ...]
    vae_layers: int


TINY = AssetShape(205, 64, 64, 2, 256, (16, 16, 32, 32), 1)
SD3_MEDIUM = AssetShape(333, 4096, 2048, 1, 512, (128, 256, 512, 512), 2)


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


def build_text_encoder(root: Path, shape: AssetShape = TINY) -> None:
    """A character-level CLIP tokenizer (no merges) and a ``shape.text_layers``-layer
    ``CLIPTextModelWithProjection`` (``shape.text_tokens`` positions, width ``shape.text_dim``, pooled
    projection ``shape.pooled_dim``)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    tok.save_pretrained(tok_dir)
    wide = shape.text_dim > 256  # a real width: one head per 64 channels, a narrow MLP (it runs once per prompt)
    cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=shape.text_dim,
                         intermediate_size=shape.text_dim * (1 if wide else 4), num_hidden_layers=shape.text_layers,
                         num_attention_heads=shape.text_dim // 64 if wide else 2,
                         max_position_embeddings=shape.text_tokens, projection_dim=shape.pooled_dim,
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                         pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    CLIPTextModelWithProjection(cfg).save_pretrained(root / "text_encoder", safe_serialization=True)


def build_vae(root: Path, shape: AssetShape = TINY) -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=shape.vae_channels, layers_per_block=shape.vae_layers,
                        norm_num_groups=min(32, shape.vae_channels[0] // 2), sample_size=shape.image_size,
                        scaling_factor=1.5305, shift_factor=0.0609)
    vae.save_pretrained(root / "vae", safe_serialization=True)


def build_data(root: Path, n: int = 64, image_size: int = TINY.image_size) -> None:
    from PIL import Image

    from pretrain.data.emoji import list_emoji, render_emoji

    records = list_emoji()[0][:n]
    images = render_emoji([r.text for r in records], image_size)
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (r, img) in enumerate(zip(records, images)):
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(root / f"{i:03d}.png")
        lines.append(json.dumps({"file": f"{i:03d}.png", "caption": r.caption}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")


def build_assets(model: ModelConfig, export_dir: str | Path, data_dir: str | Path, shape: AssetShape = TINY,
                 emoji: bool = True) -> None:
    """Build everything once (skipped when ``export_dir`` already holds an export); the transformer is
    the ``tiny`` SD3 preset with ``model.overrides``, its inputs sized by ``shape``. ``emoji`` false: the
    captioned folder is :func:`benchmarks.gpu_check.make_shapes`' generated shapes (no OpenMoji package
    needed; a GRPO run reads only the captions)."""
    export_dir, data_dir = Path(export_dir), Path(data_dir)
    if (export_dir / META).is_file() and (data_dir / "captions.jsonl").is_file():
        return
    parts = export_dir.parent / "parts"
    build_text_encoder(parts, shape)
    build_vae(parts, shape)
    if emoji:
        build_data(data_dir, image_size=shape.image_size)
    else:
        from benchmarks.gpu_check import make_shapes

        make_shapes(data_dir)
    torch.manual_seed(0)
    latent = shape.image_size // 8
    transformer = build_transformer(ModelConfig(preset="tiny", overrides=dict(model.overrides)), latent,
                                    LATENT_CHANNELS, shape.text_dim, shape.pooled_dim)
    export_model(transformer, export_dir, ExportMeta(
        TextEncoderConfig(name="clip_folder", max_length=shape.text_tokens, path=str(parts)),
        CodecConfig(name="vae", path=str(parts)), shape.image_size, {"shift": 3.0}))
