"""A chat choice's text read for tool calls (tools on offer): the deltas of its stream chunks, or its message.

OpenAI's stream shape: a call's first delta carries its `index`, `id`, `type` and `function.name` (with `arguments`
""), the following ones `index` and `function.arguments` fragments that concatenate into the arguments' JSON text;
text outside the calls streams as `content`. A choice that made calls and stopped finishes with "tool_calls".
"""

from __future__ import annotations

import secrets
from typing import Any

from infer_server.tool_calls import ArgumentsDelta, CallStart, ContentDelta, Event, ParsedOutput, ToolCallStream
from infer_server.tools import ToolOutput


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def finish_reason(reason: str, made_calls: bool) -> str:
    return "tool_calls" if made_calls and reason == "stop" else reason


class ChoiceTools:
    """One streamed choice: text in, chunk deltas out."""

    __slots__ = ("output", "calls", "_reader", "_ids")

    def __init__(self, output: ToolOutput) -> None:
        self.output = output
        self.calls = 0  # calls started (those kept: the first only without parallel_tool_calls)
        self._reader: ToolCallStream = output.format.stream()
        self._ids: list[str] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._reader.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._reader.finish())

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append({"content": event.text})
            elif not self.output.parallel and event.index > 0:
                continue  # parallel_tool_calls false: the first call only
            elif isinstance(event, CallStart):
                self._ids.append(call_id())
                self.calls += 1
                out.append({"tool_calls": [{"index": event.index, "id": self._ids[event.index], "type": "function",
                                            "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ArgumentsDelta):
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return out


def tool_message(parsed: ParsedOutput, output: ToolOutput) -> dict[str, Any]:
    """A whole choice's message: content (None when all of it was calls) and its tool calls."""
    calls = parsed.calls if output.parallel else parsed.calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if calls else parsed.content or ""}
    if calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message
