"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from a GGUF file's tokenizer metadata.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary, the merges, token types and special ids
under `tokenizer.ggml.*`. For a GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) those are
enough to rebuild the exact HF tokenizer: BPE model + byte-level pre-tokenizer/decoder + added special tokens.

The one piece the metadata only names is the pre-tokenizer split (`tokenizer.ggml.pre`). For `smollm` (and
StarCoder-family vocabularies) llama.cpp splits every digit on its own before the GPT-2 regex, which is
what the original SmolLM2 `tokenizer.json` does with `Digits(individual_digits=True)`. transformers' own GGUF
tokenizer loader does not know `smollm` and falls back to plain GPT-2 splitting; the two agree on every text
except a run of several whitespaces directly before a digit, where we follow llama.cpp/the original model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's `llama_token_type`: 3 is CONTROL (special, e.g. <|im_start|>), 4 USER_DEFINED (added, not special).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose split is "each digit alone, then the GPT-2 regex" (llama-vocab.cpp groups them).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
# Values whose split is the plain GPT-2 regex.
_GPT2_SPLIT_PRE = frozenset({"gpt2", "default", "mpt", "olmo", "jais"})


@dataclass(frozen=True)
class GgufTokenizerSpec:
    """The tokenizer facts a GGUF states, in HF terms."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]

    @property
    def control_tokens(self) -> list[str]:
        return [t for t, kind in zip(self.tokens, self.token_types) if kind == TOKEN_TYPE_CONTROL]

    @property
    def user_defined_tokens(self) -> list[str]:
        return [t for t, kind in zip(self.tokens, self.token_types) if kind == TOKEN_TYPE_USER_DEFINED]


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the alphabet byte-level BPE vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_spelling(token: str) -> str:
    """A vocabulary entry as byte-level BPE spells it. llama.cpp normally stores them already spelled; an entry
    with characters outside the byte alphabet is re-spelled from its UTF-8 bytes (as transformers does)."""
    table = _bytes_to_unicode()
    alphabet = set(table.values())
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_SPLIT_PRE:
        return byte_level
    # Guessing a split silently would tokenize "almost right", which is worse than refusing.
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(_DIGIT_SPLIT_PRE | _GPT2_SPLIT_PRE)}")


def build_tokenizer(spec: GgufTokenizerSpec) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF describes, with control tokens as special added tokens."""
    vocab = {_byte_level_spelling(token): index for index, token in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise ValueError("GGUF vocabulary has duplicate entries after byte-level spelling")
    merges = [tuple(merge.split(" ", 1)) for merge in spec.merges]
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        unk_token=None,  # byte-level BPE can spell any input, so it never needs an unknown token
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(spec.pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # normalized=False: control tokens are matched verbatim in the raw text, before any pre-tokenization.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.control_tokens])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.user_defined_tokens])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(spec.tokens):
        raise ValueError("added tokens must already be part of the GGUF vocabulary")
    return tokenizer


def tokenizer_config(spec: GgufTokenizerSpec, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: what transformers and our server read next to `tokenizer.json`."""
    config: dict[str, Any] = {
        # Not "GPT2Tokenizer": transformers 5 rebuilds that class from vocab+merges with its own plain ByteLevel
        # pre-tokenizer, dropping the digit split. The generic fast class loads tokenizer.json verbatim (4.x and 5.x).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": spec.add_eos_token,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "bos_token": spec.token(spec.bos_token_id),
        "eos_token": spec.token(spec.eos_token_id),
        "pad_token": spec.token(spec.pad_token_id),
        "unk_token": spec.token(spec.unk_token_id),
        "additional_special_tokens": spec.control_tokens,
    }
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template
    return config

