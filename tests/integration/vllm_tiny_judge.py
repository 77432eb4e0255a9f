"""Build a tiny random VLM judge folder that vLLM can serve, with nothing from a hub: an Idefics3 (SmolVLM
architecture) of about 0.2 M parameters, a byte-level BPE tokenizer trained here on the judging texts, the
Idefics3 image processor and a chat template. Run with the vLLM venv's Python (its transformers writes the
config that its vLLM reads): ``python tests/integration/vllm_tiny_judge.py OUT_DIR``.

The answers of a random model are arbitrary text; what the real-vLLM test checks is the protocol (requests,
log-probs, seeds, restarts, failures), not the judgement."""

from __future__ import annotations

import sys
from pathlib import Path

#: Image side the vision tower sees, its patch, and the pixel-shuffle factor: 16 patches -> 4 image tokens.
IMAGE, PATCH, SCALE = 32, 8, 2
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
                 "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                 "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
                 "{% else %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
CORPUS = [
    "How well does this image match the description? Rate it from 0 to 10. Answer only with 'Score: <number>'.",
    "Score: 0 1 2 3 4 5 6 7 8 9 10. Does this image show a red circle? Answer Yes or No. yes no",
    "Which of the two images matches the description better? Answer only with 1 (the first image), 2 (the "
    "second image) or tie. Rank these images by how well each matches, best first.",
    "a red circle and a blue square above a green triangle; two yellow circles; three green triangles.",
]


def special_tokens() -> list[str]:
    return (["<unk>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
            + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def build(out: Path) -> Path:
    """Write the model, tokenizer and processor to ``out`` and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, PreTrainedTokenizerFast)

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=512, special_tokens=special_tokens(),
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<end_of_utterance>", pad_token="<unk>",
                                  additional_special_tokens=special_tokens()[3:])
    tok.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": IMAGE},
                                             max_image_size={"longest_edge": IMAGE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                                  image_seq_len=(IMAGE // PATCH) ** 2 // SCALE ** 2, chat_template=CHAT_TEMPLATE)
    width = 64  # 2 heads of 32: the smallest head size vLLM's CPU attention serves
    cfg = Idefics3Config(
        vision_config={"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": IMAGE, "patch_size": PATCH},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": width,
                     "intermediate_size": 2 * width, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "max_position_embeddings": 512, "pad_token_id": tok.pad_token_id,
                     "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id},
        scale_factor=SCALE, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Idefics3 judge: {n / 1e6:.2f} M parameters, vocabulary {len(tok)} -> {out}")
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]))
