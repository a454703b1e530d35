"""Llama 3 JSON tool calls: the whole turn is `{"name": "f", "parameters": {...}}`, several joined by `; `, after an
optional `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3). A turn that starts otherwise is content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infer_server.tool_calls.base import CallReader, ContentDelta, ContentWriter, Event, held_prefix

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


@dataclass(slots=True)
class Llama3JsonStream:
    _buffer: str = ""
    _mode: str = "start"  # start (undecided), calls, content
    _call: CallReader | None = None
    _calls: int = 0
    _content: ContentWriter = field(default_factory=ContentWriter)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        if self._mode == "start":
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if not head or (len(head) < len(PYTHON_TAG) and held_prefix(head, PYTHON_TAG) == len(head)):
                return events
            if head[0] != "{":
                self._mode = "content"
            else:
                self._mode, self._buffer, self._call = "calls", head, CallReader(0)
        if self._mode == "content":
            events += self._content.write(self._buffer)
            self._buffer = ""
            return events
        while self._call is not None:
            events += self._call.read(self._buffer)
            if self._call.end is None:
                return events
            if not self._call.valid:  # an object that is no call: the rest of the turn is content
                return events + self._to_content()
            rest = self._buffer[self._call.end:].lstrip()
            if not rest or (rest[0] == ";" and not rest[1:].strip()):
                return events
            if rest[0] != ";":
                self._buffer = rest
                return events + self._to_content()
            self._buffer = rest[1:].lstrip()
            self._calls += 1
            self._call = CallReader(self._calls) if self._buffer.startswith("{") else None
            if self._call is None:
                return events + self._to_content()
        return events

    def _to_content(self) -> list[Event]:
        self._mode, self._call = "content", None
        events = self._content.write(self._buffer)
        self._buffer = ""
        return events

    def finish(self) -> list[Event]:
        if self._mode == "start":
            return [ContentDelta(self._buffer.strip())] if self._buffer.strip() else []
        if self._call is not None and not self._call.started:
            return self._content.write(self._buffer)
        return []


class Llama3Json:
    name = "llama3_json"
    separator = SEPARATOR

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    def tag(self, function: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(function)}, "parameters": ', "}"

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return SEPARATOR.join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                              for c in calls)

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You have access to these functions. To call one, answer with nothing but a JSON object "
                '{"name": function name, "parameters": an object of argument names and values}; '
                f"several calls are joined by '{SEPARATOR.strip()} '.\n\n{listed}")

    def render_result(self, content: str) -> str:
        return content
