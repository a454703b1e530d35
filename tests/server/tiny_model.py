"""A tiny HF model directory for the server tests: a byte-level BPE tokenizer trained in milliseconds on a
few sentences with the `tokenizers` library, a ChatML template, and EOS ids in generation_config.json and
config.json. No weights: the fake scheduler does the "generation"."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! The capital of France is Paris.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little model that answered every question.",
    "The quick brown fox jumps over the lazy dog. STOP here and stop there.",
    "user assistant system hello there how are you today",
] * 20


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def write_model_dir(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, max_position_embeddings: int = 128) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    eot = tok.token_to_id("<|endoftext|>")
    cfg: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "eos_token_id": eot, "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_position_embeddings,
    }))
    return path
