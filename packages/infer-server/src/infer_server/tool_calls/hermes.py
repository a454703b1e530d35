"""Hermes / Qwen tool calls: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number of them,
with free text around them (Qwen2.5, Qwen3, Hermes 2/3 and the fallback prompt of templates without tools)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infer_server.tool_calls.base import CallReader, ContentWriter, Event, held_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class HermesStream:
    _buffer: str = ""  # text not decided yet
    _call: CallReader | None = None  # the call being read (inside <tool_call>)
    _calls: int = 0
    _content: ContentWriter = field(default_factory=ContentWriter)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._call is None:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = held_prefix(self._buffer, OPEN)
                    events += self._content.write(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                events += self._content.write(self._buffer[:at])
                self._buffer = self._buffer[at:]
                self._call = CallReader(self._calls)
            rest = self._buffer[len(OPEN):]
            body_at = len(OPEN) + len(rest) - len(rest.lstrip())
            body = self._buffer[body_at:]
            if not body:
                return events
            if body[0] != "{":  # not a JSON call: the tag is text, up to its close tag
                close = self._buffer.find(CLOSE)
                if close < 0:
                    return events
                events += self._as_text(close)
                continue
            events += self._call.read(body)
            if self._call.end is None:
                return events
            close = self._buffer.find(CLOSE, body_at + self._call.end)
            if close < 0:
                return events
            if not self._call.valid:
                events += self._as_text(close)
                continue
            self._buffer = self._buffer[close + len(CLOSE):]
            self._call = None
            self._calls += 1

    def _as_text(self, close: int) -> list[Event]:
        """The open tag up to its close tag becomes content."""
        text, self._buffer = self._buffer[: close + len(CLOSE)], self._buffer[close + len(CLOSE):]
        self._call = None
        return self._content.write(text)

    def finish(self) -> list[Event]:
        """The end of the output: a call cut short keeps what it had (a call whose name never came is text)."""
        if self._call is not None and self._call.started:
            return []
        return self._content.write(self._buffer)


class Hermes:
    name = "hermes"
    separator = "\n"

    def stream(self) -> HermesStream:
        return HermesStream()

    def tag(self, function: str) -> tuple[str, str]:
        return f'{OPEN}\n{{"name": {json.dumps(function)}, "arguments": ', f"}}\n{CLOSE}"

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}"
                         f"\n{CLOSE}" for c in calls)

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to answer. Their signatures, as JSON Schema, within "
                f"<tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\nTo call a function, write a JSON object "
                f"with its name and arguments within {OPEN}{CLOSE} tags:\n{OPEN}\n"
                f'{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CLOSE}')

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
