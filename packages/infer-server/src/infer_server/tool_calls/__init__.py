"""Tool calls in the model's output, one module per model family's format; `resolve` picks the format the config
names, or (auto) the one the chat template's text shows."""

from __future__ import annotations

from infer_server.tool_calls.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    ToolCallStream,
    assemble,
    parse,
)
from infer_server.tool_calls.hermes import Hermes
from infer_server.tool_calls.llama3_json import PYTHON_TAG, Llama3Json

FORMATS: dict[str, ToolCallFormat] = {"hermes": Hermes(), "llama3_json": Llama3Json()}


def resolve(setting: str, template_source: str | None) -> ToolCallFormat | None:
    """The format of `tool_call_parser` (None for "none"). auto: Llama 3's when the template writes its python tag
    or its `ipython` role, else Hermes' (Qwen's; also what the fallback prompt of a template without tools asks)."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    source = template_source or ""
    if PYTHON_TAG in source or "ipython" in source:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


__all__ = ["FORMATS", "ArgumentsDelta", "CallStart", "ContentDelta", "Event", "ParsedOutput", "ToolCall",
           "ToolCallFormat", "ToolCallStream", "assemble", "parse", "resolve"]
