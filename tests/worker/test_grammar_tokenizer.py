"""The vocabulary xgrammar masks over is read from tokenizer.json as the server's detokenizer reads it: every token
a JSON string grammar allows decodes (through `tokenizers`, as the client receives it) to no control character,
SentencePiece vocabularies are read as such, and a mis-read vocabulary is refused rather than served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
from tokenizers import Tokenizer, decoders, models, normalizers  # noqa: E402

from infer_worker.infrastructure.grammar_tokenizer import (  # noqa: E402
    adds_prefix_space, check_decoding, tokenizer_info, tokenizer_info_factory, vocab_type)

STRING_SCHEMA = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})


def test_byte_level_vocab_allows_no_control_character_inside_a_json_string(embedded_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(embedded_model_dir / "tokenizer.json"))
    info = tokenizer_info_factory(embedded_model_dir)(49152)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    tab = tokenizer.token_to_id("\u0109")  # GPT-2's printable stand-in for byte 0x09
    assert bytes(info.decoded_vocab[tab]) == b"\t"
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        STRING_SCHEMA, any_whitespace=False, strict_mode=True))
    for token in tokenizer.encode('{"s": "ab', add_special_tokens=False).ids:
        assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = ((bitmask[0][:, None] >> torch.arange(32)) & 1).bool().reshape(-1)[:49152].nonzero().flatten().tolist()
    assert len(allowed) > 10_000  # the string goes on with most of the vocabulary
    texts = tokenizer.decode_batch([[t] for t in allowed], skip_special_tokens=False)
    assert not [t for t in texts if any(ord(c) < 0x20 for c in t)]
    assert tab not in allowed


def _sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, byte tokens <0xNN>, a prepended "▁" on the first word."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁Hello", "▁world", ",", "!", "▁", "e"]
    tokenizer = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def test_sentencepiece_vocab_is_read_with_its_byte_tokens_and_prefix_space() -> None:
    tokenizer = _sentencepiece_tokenizer()
    spec = json.loads(tokenizer.to_str())
    assert vocab_type(spec) == xgr.VocabType.BYTE_FALLBACK and adds_prefix_space(spec)
    info = tokenizer_info(tokenizer, tokenizer.get_vocab_size() + 7)  # logits padded past the vocabulary
    assert bytes(info.decoded_vocab[3 + 0x09]) == b"\t" and bytes(info.decoded_vocab[3 + 256]) == b" Hello"


def test_a_vocabulary_read_the_wrong_way_is_refused(embedded_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(embedded_model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * 49152
    for token, index in vocab.items():
        encoded[index] = token
    raw = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW, vocab_size=49152)  # what went wrong on the H200
    with pytest.raises(ValueError, match="reads this tokenizer's vocabulary differently"):
        check_decoding(tokenizer, raw)
