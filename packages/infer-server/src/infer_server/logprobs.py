"""Token logprobs in OpenAI's two schemas.

Chat (`choice.logprobs`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`, one entry per visible token, `top_logprobs` most likely first.
Completions (`choice.logprobs`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`: parallel
lists; each `top_logprobs` item maps token text -> logprob for the requested most likely tokens plus the
sampled one (so up to `logprobs + 1` entries, as OpenAI documents); `text_offset` is the character offset
of each token in the completion text.

Logprobs are of the model's raw distribution (before penalties, temperature and filters), as vLLM's
default. `token` is the token's own text; `bytes` its UTF-8 bytes, which for a token holding part of a
character are not valid UTF-8 on their own (the text then shows them as `\\xNN` escapes). The stop token
that ended a sequence is not part of the text, so it has no entry either. -inf (impossible for a raw
logit, but JSON has no infinity) is reported as -9999.0, like vLLM.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from infer_server.tokenizer import Tokenizer

_MIN_LOGPROB = -9999.0


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: Sequence[tuple[int, float]]  # (token id, logprob), most likely first; empty when none were asked for


def _lp(value: float) -> float:
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN (never expected) to the floor


class LogprobsFormatter:
    """Formats the logprobs of one response's choices; completions keep a running text offset per choice."""

    def __init__(self, kind: Literal["chat", "completion"], tokenizer: Tokenizer, n: int) -> None:
        self.kind = kind
        self._tok = tokenizer
        self._offsets = [0] * n
        self._decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]
        self._texts: dict[int, str] = {}

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.token_bytes(token_id).decode("utf-8", errors="backslashreplace")
            self._texts[token_id] = text
        return text

    def format(self, index: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The `logprobs` object of choice `index` for these tokens (the next ones of that choice)."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        return self._completion(index, entries)

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        bytes_of = self._tok.token_bytes
        return {
            "token": self._text(e.token_id),
            "logprob": _lp(e.logprob),
            "bytes": list(bytes_of(e.token_id)),
            "top_logprobs": [{"token": self._text(t), "logprob": _lp(v), "bytes": list(bytes_of(t))} for t, v in e.top],
        }

    def prompt(self, index: int, prompt_ids: Sequence[int], logprobs: Sequence[float],
               tops: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any]:
        """Completions' `logprobs` for the prompt tokens of an echoed choice (before its generated ones, which
        `format` then offsets after them): the first token has no logprob (null), as in OpenAI's legacy API."""
        first = self._completion(index, [TokenLogprob(prompt_ids[0], 0.0, ())])
        first["token_logprobs"], first["top_logprobs"] = [None], [None]
        rest = self._completion(index, [TokenLogprob(t, lp, top)
                                        for t, lp, top in zip(prompt_ids[1:], logprobs, tops, strict=True)])
        return {key: first[key] + rest[key] for key in first}

    def _completion(self, index: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        offset = self._offsets[index]
        decoder = self._decoders[index]
        for e in entries:
            text = self._text(e.token_id)
            tokens.append(text)
            token_logprobs.append(_lp(e.logprob))
            top = {self._text(t): _lp(v) for t, v in e.top}
            top.setdefault(text, _lp(e.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(decoder.decode(self._tok.token_bytes(e.token_id)))  # whole characters only
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
