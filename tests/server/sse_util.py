"""Reading SSE streams in the tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def parse_sse(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of a stream: decoded JSON objects, and the string "[DONE]"."""
    events: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat_text(events: list[Any]) -> str:
    return "".join(
        c["delta"].get("content", "") for e in events if isinstance(e, dict) for c in e.get("choices", [])
    )


def completion_text(events: list[Any]) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
