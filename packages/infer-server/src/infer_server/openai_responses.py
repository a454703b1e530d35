"""The OpenAI response and chunk bodies, for chat (`chat.completion[.chunk]`) and completions
(`text_completion`). Plain dicts: they are serialised with msgspec, no pydantic on the hot path."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]


class UsageReporting(enum.Enum):
    """Where a stream reports `usage` (OpenAI's `stream_options`)."""

    NONE = "none"
    FINAL = "final"  # include_usage: a last chunk with `choices: []`; every other chunk has `usage: null`
    CONTINUOUS = "continuous"  # and continuous_usage_stats (vLLM): every chunk carries the running usage


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; `cached_tokens`: the prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """Everything constant across the chunks/choices of one response."""

    kind: Kind
    id: str
    created: int
    model: str
    n: int
    prompt_tokens: int
    usage_reporting: UsageReporting = UsageReporting.NONE
    return_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return self.usage_reporting is not UsageReporting.NONE

    # ---------------------------------------------------------------- streaming

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def counted(self, chunk: dict[str, Any], completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """`chunk` with the running usage when the client asked for continuous usage stats."""
        if self.usage_reporting is UsageReporting.CONTINUOUS:
            chunk["usage"] = usage(self.prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def role_chunk(self, index: int) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chat chunk with this delta (`content`, or `tool_calls` fragments)."""
        return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None})

    def text_chunk(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            return self.delta_chunk(index, {"content": text}, logprobs)
        return self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})

    def finish_chunk(self, index: int, finish_reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            return self._chunk({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._chunk({"index": index, "text": "", "logprobs": logprobs, "finish_reason": finish_reason})

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens),
        }

    # ---------------------------------------------------------------- non-streaming

    def full_response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        completion_tokens: int,
        cached_tokens: int,
        token_ids: list[list[int]] | None = None,
        logprobs: list[dict[str, Any] | None] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """`messages`: chat choices' messages in place of their text (tool calls read from it)."""
        choices: list[dict[str, Any]] = []
        for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True)):
            lp = logprobs[i] if logprobs is not None else None
            if self.kind == "chat":
                message = messages[i] if messages is not None else {"role": "assistant", "content": text}
                choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
            if self.return_token_ids and token_ids is not None:
                choice["token_ids"] = token_ids[i]
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens),
            "system_fingerprint": None,
        }
