"""What every tool-call format shares: the parsed values, the stream events, and the incremental reader of one call's
JSON object (`{"name": ..., "arguments": {...}}`), which streams the arguments as their text arrives.

A format (one module per model family) reads the model's output text as it grows and emits events: plain content,
the start of a call (its name), fragments of its arguments' JSON text. Reading the whole text at once is the same
machine fed once, so a response and its stream always agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

class ContentDelta(NamedTuple):
    text: str


class CallStart(NamedTuple):
    index: int  # the call's position among the choice's calls
    name: str


class ArgumentsDelta(NamedTuple):
    index: int
    text: str  # a fragment of the arguments' JSON text; a call's fragments concatenate into a JSON document


Event = ContentDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    calls: tuple[ToolCall, ...]


@dataclass(slots=True)
class JsonEnd:
    """Finds where the JSON object or array opening at `start` ends, in a text that grows: each `scan` goes on
    from where the last one stopped (a stream's text is scanned once, not once per token). A scanner of brackets
    outside strings: it finds the end, json.loads judges the validity."""

    start: int
    _pos: int = -1
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    end: int | None = None  # just past the value, once it closed

    def scan(self, text: str) -> int | None:
        if self.end is not None:
            return self.end
        i = max(self._pos, self.start)
        while i < len(text):
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i
                    break
        self._pos = i
        return self.end


# `{"name": "<name>", "arguments": ` (or "parameters", Llama 3's key), the name first: then the arguments stream.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _decode_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call object, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return value["name"], args
    return value["name"], json.dumps(args, ensure_ascii=False)


@dataclass(slots=True)
class CallReader:
    """One call's JSON object, read as its text grows: the name once it is whole, then the arguments' text as it
    comes (when the name comes first and the arguments are an object), else everything once the object closes."""

    index: int
    started: bool = False  # CallStart emitted
    _args: JsonEnd | None = None  # the arguments object, once the name came first (then they stream)
    _sent: int = 0  # characters of the arguments' text emitted
    _object: JsonEnd = field(default_factory=lambda: JsonEnd(0))
    end: int | None = None  # just past the object, once it closed
    valid: bool = False  # the closed object is a call

    def read(self, body: str) -> list[Event]:
        """`body`: the call's text so far, from its `{` (it only grows between calls)."""
        events: list[Event] = []
        self.end = self._object.scan(body)
        if not self.started:
            head = _CALL_HEAD.match(body)
            if head is not None and head.end() < len(body) and body[head.end()] == "{":
                events.append(CallStart(self.index, json.loads(f'"{head.group(1)}"')))
                self.started, self._args = True, JsonEnd(head.end())
        if self._args is not None:
            start = self._args.start
            stop = self._args.scan(body) or len(body)
            if stop > start + self._sent:
                events.append(ArgumentsDelta(self.index, body[start + self._sent:stop]))
                self._sent = stop - start
        if self.end is not None and not self.valid:
            decoded = _decode_call(body[: self.end])
            self.valid = decoded is not None or self.started
            if decoded is not None and not self.started:
                self.started = True
                events += [CallStart(self.index, decoded[0]), ArgumentsDelta(self.index, decoded[1])]
        return events


@dataclass(slots=True)
class ContentWriter:
    """Content as it streams: whitespace is held back until more text follows, so the content of a stream is its
    text with the whitespace around the calls trimmed (what the whole-text reading gives)."""

    _held: str = ""
    _any: bool = False

    def write(self, text: str) -> list[Event]:
        stripped = text.rstrip()
        if not stripped:
            self._held += text if self._any else ""
            return []
        out = (self._held + text[: len(stripped)]) if self._any else stripped.lstrip()
        self._any = True
        self._held = text[len(stripped):]
        return [ContentDelta(out)]


class ToolCallStream(Protocol):
    """A format's reader of one choice's output."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class ToolCallFormat(Protocol):
    """A model family's tool-call format: how calls are read, forced, and shown to a template that has no tools."""

    name: str

    def stream(self) -> ToolCallStream: ...

    def tag(self, function: str) -> tuple[str, str]:
        """The text before and after a call's arguments object (the structural tag that forces a call)."""
        ...

    separator: str  # between forced calls

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """An assistant turn's calls as the model writes them (for templates that cannot render tool_calls)."""
        ...

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tools as a system prompt (for templates that ignore `tools`)."""
        ...

    def render_result(self, content: str) -> str:
        """A tool's result as the model expects to read it (for templates that ignore tools)."""
        ...


def parse(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    """The whole output at once: the stream fed once."""
    reader = fmt.stream()
    return assemble(reader.feed(text) + reader.finish())


def assemble(events: Sequence[Event]) -> ParsedOutput:
    content: list[str] = []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names[event.index] = event.name
            args[event.index] = []
        else:
            args[event.index].append(event.text)
    text = "".join(content)
    calls = tuple(ToolCall(names[i], "".join(args[i])) for i in sorted(names))
    return ParsedOutput(text or None, calls)


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (held back until more text decides)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
