"""Which chunks of an OpenAI stream carry a generated token, as vLLM's benchmark counts them (the TTFT is the first
such chunk, each later one an inter-token gap). Imported as a sibling module by the streaming benches."""

from __future__ import annotations

from typing import Any


def token_text(chunk: dict[str, Any]) -> str | None:
    """The text of `chunk` when it carries a generated token, else None. A token's chunk has `content` (chat) or
    `text` (completion), even empty: a token whose text the server holds back (a partial UTF-8 character, text that
    may begin a stop string) streams as an empty delta, as vLLM streams it. Not tokens: the role chunk, a finish
    chunk of its own without text, the usage chunk, tool-call fragments."""
    choices = chunk.get("choices")
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    text = choice.get("text") if delta is None else (None if "role" in delta else delta.get("content"))
    if text is None or (not text and choice.get("finish_reason") is not None):
        return None
    return text
