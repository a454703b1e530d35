"""The model's tokenizer as xgrammar sees it (the vocabulary its token bitmasks are over).

Built from the model directory's `tokenizer.json` through the `tokenizers` library, the file and library the server
detokenizes with, so that the bytes a grammar allows for a token are the bytes the client receives for it. (Through
transformers' AutoTokenizer, xgrammar's `from_huggingface`, the two can part: transformers may rebuild a tokenizer
and drop the decoder xgrammar detects the vocabulary's encoding from. On the H200's image, with another
transformers version, JSON outputs held raw tabs inside strings that the grammar forbids.) A self-check decodes a
probe text token by token through xgrammar's view and refuses to serve grammars when that differs from the text.

Loaded on the first structured-output request only (the vocabulary scan costs a second or two).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

# Control characters, a tab, newlines, quotes and non-ASCII: what a mis-read vocabulary gets wrong.
PROBE_TEXT = 'Hello, world!\n\t{"key": "value\\n", "n": 42}\r\n  déjà vu — 東京 🙂'


def tokenizer_info_factory(model_dir: Path) -> Callable[[int], Any]:
    def load(vocab_size: int) -> Any:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"structured outputs need {path}, which the model directory lacks")
        return tokenizer_info(Tokenizer.from_file(str(path)), vocab_size)

    return load


def tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    """xgrammar's TokenizerInfo for a `tokenizers.Tokenizer` and the model's logits width (it may pad past the
    tokenizer's ids: those are never allowed). Raises ValueError when the self-check fails."""
    import xgrammar as xgr

    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    info = xgr.TokenizerInfo(encoded, vocab_type=vocab_type(spec), vocab_size=vocab_size,
                             stop_token_ids=None, add_prefix_space=adds_prefix_space(spec))
    check_decoding(tokenizer, info)
    return info


def _components(node: Any, key: str) -> list[dict]:
    """A tokenizer.json component (`decoder`, `normalizer`, `pre_tokenizer`) and its `Sequence` members."""
    found, stack = [], [node.get(key)] if isinstance(node, dict) else []
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            continue
        found.append(item)
        for child in ("decoders", "normalizers", "pretokenizers"):
            stack.extend(item.get(child) or [])
    return found


def vocab_type(spec: dict) -> Any:
    """How the vocabulary's strings encode bytes, read from the decoder that turns them back into text."""
    import xgrammar as xgr

    kinds = {d.get("type") for d in _components(spec, "decoder")}
    if "ByteLevel" in kinds:  # GPT-2 style: every byte mapped to a printable character (Llama 3, Qwen, SmolLM2)
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:  # SentencePiece style: "▁" for spaces, <0xNN> for bytes (Llama 2, Mistral)
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def adds_prefix_space(spec: dict) -> bool:
    """Whether encoding prepends a space (SentencePiece's "▁" on the first word), which decoding then strips."""
    for item in _components(spec, "normalizer"):
        if item.get("type") == "Prepend":
            return True
    for item in _components(spec, "pre_tokenizer"):
        if item.get("type") == "Metaspace" and item.get("prepend_scheme", "always") != "never":
            return True
    return False


def check_decoding(tokenizer: Any, info: Any) -> None:
    """xgrammar's bytes for the probe's tokens, joined, must be the probe (the grammar and the client must agree
    on what each token says)."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids
    decoded = b"".join(bytes(info.decoded_vocab[i]) for i in ids).decode("utf-8", errors="replace")
    expected = tokenizer.decode(ids, skip_special_tokens=False)
    if decoded.lstrip(" ") != expected.lstrip(" "):  # a SentencePiece prefix space is the tokenizer's own choice
        raise ValueError(f"the grammar engine reads this tokenizer's vocabulary differently from its decoder "
                         f"({info.vocab_type.name}: {decoded[:40]!r} for {expected[:40]!r}); structured outputs "
                         f"are unavailable for this model")
