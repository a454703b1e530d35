"""HF `tokenizers` wrapper and the incremental detokenizer.

The detokenizer decodes a sliding window of recent tokens (the "prefix/read offset" scheme of TGI and vLLM):
the text of a token depends on its neighbours (leading spaces, byte-level pieces of one character), so
each step decodes `ids[prefix:]` and emits what it adds to `ids[prefix:read]`. Text that ends in U+FFFD is
an incomplete UTF-8 sequence (a character split across tokens): it is held back until the next token
completes it, so a client never sees broken characters. Special tokens are skipped by default.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

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


class Tokenizer:
    """A HF fast tokenizer (`tokenizer.json`) plus the special tokens named in `tokenizer_config.json`."""

    def __init__(self, hf: HfTokenizer, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token

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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens=skip_special_tokens)


def read_tokenizer_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    __slots__ = ("_tok", "_ids", "_prefix", "_read", "_skip")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A context that itself ends in a broken character would shift every later delta: drop it then.
        if context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    @property
    def num_generated(self) -> int:
        return len(self._ids)

    def _window_delta(self) -> tuple[str, bool]:
        decode = self._tok.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full_text) > len(prefix_text):
            return full_text[len(prefix_text) :], True
        return "", False

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new complete text (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        delta, grew = self._window_delta()
        if not grew or delta.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still incomplete: hold back
        self._prefix = self._read
        self._read = len(self._ids)
        return delta

    def flush(self) -> str:
        """The request ended: emit whatever is still held back, broken or not."""
        if self._read >= len(self._ids):
            return ""
        delta, _ = self._window_delta()
        self._prefix = self._read
        self._read = len(self._ids)
        return delta
