"""Tiny tokenizers of the real classes for tiny pipeline folders (no downloads): a byte-level BPE
``CLIPTokenizer``, a ``T5TokenizerFast`` (also what UMT5 pipelines load) over a small unigram
vocabulary and a byte-level ``Qwen2TokenizerFast``."""

from __future__ import annotations

from tests.unit.tiny_reward_models import tiny_clip_tokenizer


def clip_tokenizer(model_max_length: int = 77):
    """``CLIPTokenizer`` (vocab ~520 ids) with ``model_max_length`` (pipelines pad/truncate to it)."""
    tok = tiny_clip_tokenizer()
    tok.model_max_length = model_max_length
    return tok


def t5_tokenizer(model_max_length: int = 512):
    """``T5TokenizerFast`` over a unigram vocabulary of ``<pad>``, ``</s>``, ``<unk>``, the lowercase
    letters, digits and a few words (with and without the metaspace prefix); ids < 100."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += [("\u2581" + w, -1.0) for w in ("a", "red", "apple", "face", "flag", "cat", "the", "of", "moving")]
    tk = Tokenizer(models.Unigram(pieces, unk_id=2))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tok = T5TokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                          extra_ids=0, model_max_length=model_max_length)
    return tok


#: The ids :func:`qwen2_tokenizer` gives Qwen2-VL's vision markers with ``vision=True``.
VISION_START, VISION_END, IMAGE_PAD = 259, 260, 261


def qwen2_tokenizer(model_max_length: int = 2048, vision: bool = False):
    """``Qwen2TokenizerFast``: byte-level BPE over the 256 byte symbols (no merges: one token per byte) plus
    ``<|endoftext|>`` (pad, eos), ``<|im_start|>`` and ``<|im_end|>`` (Qwen's chat-template markers);
    ids < 259. ``vision``: also ``<|vision_start|>``, ``<|vision_end|>`` and ``<|image_pad|>`` (ids
    :data:`VISION_START`, :data:`VISION_END`, :data:`IMAGE_PAD`), what a ``Qwen2VLProcessor`` needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"] if vision else []
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return Qwen2TokenizerFast(tokenizer_object=tk, unk_token=None, bos_token=None, eos_token=specials[0],
                              pad_token=specials[0], additional_special_tokens=specials[1:],
                              model_max_length=model_max_length)
