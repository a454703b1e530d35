"""bench/sse_tokens.py: which streamed chunks count as a generated token (vLLM's benchmark definition)."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_bench_script

sse_tokens = load_bench_script("sse_tokens")


def _chat(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _completion(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


@pytest.mark.parametrize(("chunk", "expected"), [
    (_chat({"content": " Paris"}), " Paris"),
    (_chat({"content": ""}), ""),  # a token whose text is held back
    (_chat({"content": "."}, "stop"), "."),  # vLLM: the last token's text with the finish reason
    (_completion(" Paris"), " Paris"),
    (_completion(""), ""),
    (_completion("!", "length"), "!"),
])
def test_token_chunks(chunk: dict, expected: str) -> None:
    assert sse_tokens.token_text(chunk) == expected


@pytest.mark.parametrize("chunk", [
    _chat({"role": "assistant", "content": ""}),  # the role chunk, before any token
    _chat({}, "stop"),  # a finish chunk of its own
    _completion("", "stop"),
    {"choices": [], "usage": {"completion_tokens": 3}},
    _chat({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
    {"error": {"message": "boom"}},
])
def test_not_token_chunks(chunk: dict) -> None:
    assert sse_tokens.token_text(chunk) is None
