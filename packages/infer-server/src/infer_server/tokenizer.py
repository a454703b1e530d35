"""HF `tokenizers` wrapper and the incremental detokenizer.

The detokenizer is the library's `tokenizers.decoders.DecodeStream` (the "prefix/read offset" scheme of TGI and
vLLM, in Rust): the text of a token depends on its neighbours (leading spaces, byte-level pieces of one character),
so each step decodes the previous chunk's tokens plus the new ones and emits what they add. Text that would end in
U+FFFD is an incomplete UTF-8 sequence (a character split across tokens): the stream returns None and holds it back
until a later token completes it, so a client never sees broken characters. Special tokens are skipped by default.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models as hf_models

try:
    from tokenizers.decoders import DecodeStream
except ImportError as exc:  # tokenizers < 0.21 (pyproject asks for more; a stale environment may not have it)
    raise ImportError(
        f"infer-server needs tokenizers >= 0.21 (tokenizers.decoders.DecodeStream); found {tokenizers.__version__}"
    ) from exc

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first generated token (fixes leading-space handling of
# SentencePiece-style decoders that strip a leading space at the start of the decoded text).
_CONTEXT_TOKENS = 5


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


@dataclass(frozen=True, slots=True)
class SpecialToken:
    """A special added token (`<|im_end|>`): what `encode` turns into one id wherever its text appears."""

    id: int
    content: str
    lstrip: bool  # it swallows the whitespace before it
    rstrip: bool  # ... and after it


class Tokenizer:
    """A HF fast tokenizer (`tokenizer.json`) plus the special tokens named in `tokenizer_config.json`.

    `encode` goes through `encode_batch_fast`: `Tokenizer.encode` holds the GIL for the whole call (1.8 s for 1.3
    million words, measured with tokenizers 0.23: another thread did not run for 1.8 s), the batch calls release it,
    so a long prompt tokenized in a worker thread leaves the event loop running. The fast one computes no offsets:
    half the time, and the GIL is held a few ms (not 70) while the result is handed over and freed."""

    def __init__(self, hf: HfTokenizer, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._byte_level: bool | None = None
        self._added_ids: frozenset[int] = frozenset()
        self._token_bytes: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._literal: HfTokenizer | None = None  # a copy that encodes special-token text as text
        self._specials: tuple[SpecialToken, ...] | None = None
        self._special_re: re.Pattern[str] | None = None
        self._max_token_chars: int | None | bool = False  # False: not computed yet

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        hf = HfTokenizer.from_file(str(path))
        cfg = read_tokenizer_config(model_dir)
        return cls(hf, bos_token=_token_content(cfg.get("bos_token")), eos_token=_token_content(cfg.get("eos_token")))

    @property
    def hf(self) -> HfTokenizer:
        return self._hf

    @property
    def vocab_size(self) -> int:
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        result = self._hf.token_to_id(token)
        return None if result is None else int(result)

    def encode(self, text: str, *, add_special_tokens: bool = True, special_tokens_as_text: bool = False) -> list[int]:
        """Token ids of `text`. `special_tokens_as_text`: a special token's text (`<|im_end|>`) is tokenized as the
        ordinary text it is, never as the control token (HF's `encode_special_tokens`)."""
        hf = self._literal_hf() if special_tokens_as_text else self._hf
        ids: list[int] = hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def _literal_hf(self) -> HfTokenizer:
        # A copy of its own: `encode_special_tokens` is a setting of the tokenizer object, shared by every thread.
        with self._lock:
            if self._literal is None:
                literal = HfTokenizer.from_str(self._hf.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    @property
    def special_tokens(self) -> tuple[SpecialToken, ...]:
        """The special added tokens, longest first (the order HF matches them in: leftmost, then longest)."""
        if self._specials is None:
            found = [SpecialToken(int(i), t.content, bool(t.lstrip), bool(t.rstrip))
                     for i, t in self._hf.get_added_tokens_decoder().items() if t.special and t.content]
            self._specials = tuple(sorted(found, key=lambda t: -len(t.content)))
        return self._specials

    @property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Matches any special token's text (None when there are none)."""
        if self._special_re is None and self.special_tokens:
            self._special_re = re.compile("|".join(re.escape(t.content) for t in self.special_tokens))
        return self._special_re

    def precompute(self) -> threading.Thread | None:
        """Build what is otherwise built on first use: the special tokens, their pattern and the longest vocabulary
        piece (~0.1-0.2 s for a 150k vocabulary), then, in a background thread it returns, the copy that encodes
        special-token text as text (~1.4 s and ~54 MB for Qwen3's tokenizer on a 2-core VM). The server calls this
        while it loads the model's assets, off the event loop; left to the first request, the tables stalled that
        request and every stream of its process, and the copy would stall them for a second the first time a
        message's content holds special-token text (a request meanwhile waits for the build under the lock)."""
        _ = self.special_token_pattern, self.max_token_chars
        if not self.special_tokens:
            return None
        build = threading.Thread(target=self._literal_hf, name="rustinfer-literal-tokenizer", daemon=True)
        build.start()
        return build

    @property
    def max_token_chars(self) -> int | None:
        """The most characters of input one token can stand for, when that is certain, else None. For a BPE model
        without a normalizer (which could shrink the text) nor fused unknown tokens, every token is one vocabulary
        piece, or an added token, covering at most that many characters (a byte-level piece: one character per byte,
        at most one byte per input character). A text longer than this times the context cannot fit it."""
        if self._max_token_chars is False:
            model = self._hf.model
            certain = (isinstance(model, hf_models.BPE) and self._hf.normalizer is None
                       and not (model.unk_token and model.fuse_unk))
            if certain:
                vocab = self._hf.get_vocab(with_added_tokens=True)
                self._max_token_chars = max((len(piece) for piece in vocab), default=0) or None
            else:
                self._max_token_chars = None
        return self._max_token_chars  # type: ignore[return-value]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, on its own (cached): a byte-level BPE piece mapped back to its bytes,
        a `<0xNN>` byte-fallback piece as that byte, SentencePiece's '▁' as a space; special tokens as their
        text. A token may hold part of a UTF-8 character (logprobs report such bytes as they are)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            out = b""
        else:
            if self._byte_level is None:
                # Ask the decoder what it does with a piece of GPT-2's byte alphabet ("\u0120" is the space byte)
                # rather than parse its serialisation: a ByteLevel decoder, alone or inside a Sequence, maps it.
                decoder = self._hf.decoder
                self._byte_level = decoder is not None and decoder.decode(["a\u0120b"]) == "a b"
                self._added_ids = frozenset(self._hf.get_added_tokens_decoder())
            # added tokens (specials included) are stored as their literal text, not in the byte alphabet
            out = piece.encode("utf-8") if token_id in self._added_ids else _piece_bytes(piece, self._byte_level)
        self._token_bytes[token_id] = out
        return out

    def detokenizer(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens=skip_special_tokens)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def read_tokenizer_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    __slots__ = ("_hf", "_stream", "_skip", "_num", "_last", "_held")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        hf = tokenizer.hf
        self._hf = hf
        self._skip = skip_special_tokens
        # The last prompt tokens are the context of the first generated one (SentencePiece-style decoders strip
        # the leading space at the start of the decoded text). A context that itself ends in a broken character
        # would shift every later delta: drop it then.
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if context and hf.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
            context = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # For flush, which the stream lacks: the last emitted token (the held tail's context) and the held tail.
        self._last: int | None = None
        self._held: list[int] = []
        # The context goes through `step` (its text discarded), not DecodeStream's `ids`, which is newer than 0.21.
        self._feed(context, recover=True)
        self._held = []  # a context token held back (a skipped special one) is never output
        self._num = 0

    @property
    def num_generated(self) -> int:
        return self._num

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new complete text (possibly "")."""
        self._num += len(token_ids)
        return self._feed(token_ids, recover=True)

    def _feed(self, token_ids: Sequence[int], *, recover: bool) -> str:
        out = ""
        for t in token_ids:  # one id at a time: the list form of `step` is newer than 0.21
            try:
                text = self._stream.step(self._hf, t)
            except Exception:  # tokenizers raises a bare Exception for an invalid prefix
                if not recover:
                    raise
                # The text stopped extending what was emitted: ByteFallback decodes a run of byte tokens together,
                # so a byte that starts no valid character turns an emitted byte before it (Llama-2's newline is
                # <0x0A>) into U+FFFD. Replay the tokens not emitted yet through a fresh stream, so none is lost
                # (only the previous chunk's context is); an error of another kind comes back from the replay.
                self._stream = DecodeStream(skip_special_tokens=self._skip)
                pending, self._held = [*self._held, t], []
                out += self._feed(pending, recover=False)
                continue
            if text is None:
                self._held.append(t)  # nothing visible yet, or a character still incomplete: hold back
            else:
                out += text
                self._last = t
                if self._held:
                    self._held = []
        return out

    def flush(self) -> str:
        """The request ended: emit whatever is still held back, broken or not."""
        if not self._held:
            return ""
        context = [] if self._last is None else [self._last]
        before = self._hf.decode(context, skip_special_tokens=self._skip)
        text = self._hf.decode(context + self._held, skip_special_tokens=self._skip)
        self._held = []
        self._stream = DecodeStream(skip_special_tokens=self._skip)  # nothing is held after a flush
        return text[len(before):] if len(text) > len(before) else ""
