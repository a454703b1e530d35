"""The incremental detokenizer: never broken UTF-8, special tokens skipped, same text as a full decode."""

from __future__ import annotations

from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, normalizers

from infer_server.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, **kw: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [], **kw)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    return deltas


def test_emoji_split_across_byte_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂 done", add_special_tokens=False)
    # the tiny byte-level BPE has never seen the emoji: it is 4 single-byte tokens
    assert len(ids) >= 6
    deltas = _stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == "ok 🙂 done"
    assert "🙂" in deltas  # emitted whole, in one delta, once its 4th byte arrived
    assert deltas.count("") >= 3  # the three incomplete steps emitted nothing


def test_two_byte_chars_and_cjk(tokenizer: Tokenizer) -> None:
    text = "é ü 日本語 Paris"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_several_tokens_per_step(tokenizer: Tokenizer) -> None:
    text = "Hello world! 🙂🙂 The capital of France is Paris."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    out.append(detok.flush())
    assert "".join(out) == text
    assert all(REPLACEMENT_CHAR not in d for d in out)


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>Hello<|im_end|> world", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids)) == "Hello world"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == "<|im_start|>Hello<|im_end|> world"


def test_prompt_context_does_not_leak_into_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = tokenizer.encode(" Paris is the capital", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids, prompt)) == " Paris is the capital"


def test_prompt_ending_in_a_broken_character(tokenizer: Tokenizer) -> None:
    full = tokenizer.encode("x🙂y", add_special_tokens=False)
    prompt, gen = full[:3], full[3:]  # the prompt holds half of the emoji
    text = "".join(_stream(tokenizer, gen, prompt))
    assert text == tokenizer.decode(gen)  # no shift from the broken prompt tail


def test_flush_releases_an_incomplete_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == "a"
    assert [detok.add([t]) for t in ids[1:]] == ["", "", ""]  # the broken tail is withheld ...
    assert detok.flush() == REPLACEMENT_CHAR  # ... and only released when the request ends


def _sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2's shape: Metaspace pieces, byte fallback for what the vocabulary lacks (a newline is <0x0A>, as in
    Llama 2), the Replace/ByteFallback/Fuse/Strip decoder. Single-character pieces, no merges."""
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                                         "\u2581", *"abcdefghijklmnopqrstuvwxyzHP,.!?"])}
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(hf)


def test_byte_fallback_text_streams_whole() -> None:
    tok = _sentencepiece_tokenizer()
    text = "Hello world\n日本 is Paris\n\n🙂 today"
    ids = tok.encode(text, add_special_tokens=False)
    assert "<0x0A>" in [tok.hf.id_to_token(i) for i in ids]
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert tok.token_bytes(tok.token_to_id("<0x0A>") or 0) == b"\n"  # byte fallback read without ByteLevel


def test_byte_fallback_invalid_bytes_after_a_newline() -> None:
    """ByteFallback decodes a run of byte tokens together: '\n' (<0x0A>) then a byte that starts no valid character
    decodes as U+FFFD U+FFFD, so the text no longer extends the '\n' already emitted (the library's stream raises).
    The stream goes on: the invalid byte shows as U+FFFD and no later token is lost."""
    tok = _sentencepiece_tokenizer()
    ids = [tok.token_to_id(piece) or 0 for piece in ("a", "<0x0A>", "<0xE6>", "b", "c")]
    assert _stream(tok, ids) == ["a", "\n", "", REPLACEMENT_CHAR + "b", "c", ""]
