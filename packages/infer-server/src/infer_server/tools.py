"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`: checked (400s naming the field), shown to the model
through its chat template, and, for `required` or a named function, forced with a grammar.

**Rendering.** The tools go to the template as `tools` (HF's `apply_chat_template(tools=...)`), assistant turns with
`tool_calls` and `tool` turns with `tool_call_id` as HF's message dicts. A template that never reads `tools` (the
embedded SmolLM2's) gets them as a system prompt in the tool-call format's own words instead, and a template that
never mentions `tool_calls` gets past calls written into the assistant's content and tool results as a user turn
(in that format). Both are read from the template's text (data), never from the model's name.

**Forcing.** `required` and a named function compile to an xgrammar structural tag: only calls, each the format's
wrapper around a JSON object following the function's `parameters` schema (one call for a named function, or
without `parallel_tool_calls`); the output is then read by the format's parser like any other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infer_protocol.messages import StructuredOutput

from infer_server.chat_template import ChatTemplate
from infer_server.errors import invalid_request, unsupported
from infer_server.openai_models import ChatCompletionRequest, ChatMessage
from infer_server.params import RequestGrammar, bounded, check_grammar_fields, check_schema, request_grammar
from infer_server.tool_calls import FORMATS, ToolCallFormat, resolve

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# A forced call's JSON may hold a blank between tokens, never a run of them (a small model loops on whitespace).
_MAX_BLANKS = 1


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """How a choice's text becomes content and tool calls."""

    format: ToolCallFormat
    parallel: bool  # several calls allowed (else only the first is kept)


@dataclass(frozen=True, slots=True)
class ToolRendering:
    """How tools and tool turns reach the template: natively, or (the template ignores them) in the format's words."""

    format: ToolCallFormat
    native_tools: bool
    native_calls: bool
    tools: tuple[dict[str, Any], ...] = ()  # shown to the model (none for tool_choice "none")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    rendering: ToolRendering
    output: ToolOutput | None  # None: the text stays content (tool_choice "none")
    grammar: RequestGrammar | None  # required / a named function


def tool_format(setting: str, template: ChatTemplate | None) -> ToolCallFormat | None:
    """The configured `tool_call_parser`'s format (auto: from the template's text)."""
    return resolve(setting, template.source if template is not None else None)


def history_rendering(setting: str, template: ChatTemplate | None) -> ToolRendering:
    """Tool turns of a conversation without tools on offer (/tokenize, tool_choice "none")."""
    return rendering_for(template, tool_format(setting, template) or FORMATS["hermes"])


def rendering_for(template: ChatTemplate | None, fmt: ToolCallFormat,
                  tools: Sequence[dict[str, Any]] = ()) -> ToolRendering:
    native_tools = template is not None and template.reads("tools")
    native_calls = template is not None and "tool_calls" in template.source
    return ToolRendering(fmt, native_tools, native_calls, tuple(tools))


# ------------------------------------------------------------------ the request's tools


def _check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise invalid_request(f"'tools' holds {len(tools)} entries; at most {MAX_TOOLS} are accepted", param="tools")
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise invalid_request(f"'{where}.type' must be 'function' (got {tool.get('type')!r}): only function "
                                  "tools are served", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"Missing required parameter: '{where}.function'", param="tools",
                                  code="missing_required_parameter")
        unknown = set(tool) - {"type", "function"} or set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise invalid_request(f"'{where}' has unknown fields {sorted(unknown)}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid_request(f"'{where}.function.name' must match ^[a-zA-Z0-9_-]{{1,64}}$ (got {name!r})",
                                  param="tools")
        if name in names:
            raise invalid_request(f"'{where}.function.name' {name!r} is given twice", param="tools")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise invalid_request(f"'{where}.function.description' must be a string", param="tools")
        if not isinstance(function.get("strict", False), bool):
            raise invalid_request(f"'{where}.function.strict' must be a boolean", param="tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise invalid_request(f"'{where}.function.parameters' must be a JSON Schema object", param="tools")
        check_schema(parameters, f"{where}.function.parameters")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def _choice(req: ChatCompletionRequest, names: Sequence[str]) -> str | None:
    """tool_choice as "none", "auto", "required" or None plus the forced function's name (returned)."""
    choice = req.tool_choice
    if choice is None:  # OpenAI's default with tools: auto
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_request(f"'tool_choice' must be 'none', 'auto', 'required' or a function (got {choice!r})",
                                  param="tool_choice")
        return None
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or set(choice) - {"type", "function"}:
        raise invalid_request("'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": "
                              "...}}", param="tool_choice")
    name = function.get("name")
    if name not in names:
        raise invalid_request(f"'tool_choice' names the function {name!r}, which is not among 'tools' "
                              f"({sorted(names)})", param="tool_choice")
    return str(name)


def _forcing(fmt: ToolCallFormat, tools: Sequence[dict[str, Any]], only_one: bool) -> StructuredOutput:
    tags = []
    for tool in tools:
        function = tool["function"]
        begin, end = fmt.tag(function["name"])
        tags.append({"type": "tag", "begin": begin, "end": end, "content": {
            "type": "json_schema", "json_schema": function["parameters"], "max_whitespace_cnt": _MAX_BLANKS}})
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                "separator": fmt.separator, "at_least_one": True,
                                                "stop_after_first": only_one}}
    return StructuredOutput(kind="structural_tag",
                            schema=bounded(json.dumps(tag, sort_keys=True, ensure_ascii=False), "tools"))


def plan_tools(req: ChatCompletionRequest, setting: str, template: ChatTemplate | None) -> ToolPlan:
    """What the request's tools make of its prompt, its grammar and its output (400s naming the field).
    `setting`: the config's tool_call_parser ("none": tools are refused)."""
    fmt = tool_format(setting, template)
    tools = req.tools or []
    if req.tool_choice is not None and not tools:
        raise invalid_request("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    if req.parallel_tool_calls is not None and not tools:
        raise invalid_request("'parallel_tool_calls' is only allowed when 'tools' are given",
                              param="parallel_tool_calls")
    if not tools or req.tool_choice == "none":
        if tools:
            _check_tools(tools)
        return ToolPlan(history_rendering(setting, template), None, None)
    if fmt is None:
        raise unsupported("tools", "the server's tool_call_parser is 'none'")
    checked = _check_tools(tools)
    forced = _choice(req, [t["function"]["name"] for t in checked])
    parallel = req.parallel_tool_calls is not False
    grammar = None
    if forced is not None or req.tool_choice == "required":
        if request_grammar(req) is not None:
            raise invalid_request("'tool_choice' 'required' or a function forces the output: it cannot follow "
                                  "'response_format' / 'structured_outputs' too", param="tool_choice")
        check_grammar_fields(req, "tool_choice")
        chosen = [t for t in checked if forced is None or t["function"]["name"] == forced]
        grammar = RequestGrammar(_forcing(fmt, chosen, only_one=forced is not None or not parallel), "tool_choice")
    return ToolPlan(rendering_for(template, fmt, checked), ToolOutput(fmt, parallel), grammar)


# ------------------------------------------------------------------ the messages


def _arguments_value(text: str) -> Any:
    """A call's arguments as templates read them (HF: a dict); text that is not a JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _calls(message: ChatMessage, index: int) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(message.tool_calls or []):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                  "\"arguments\"}}}", param="messages")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise invalid_request(f"'{where}.function' needs a string 'name' and 'arguments' (JSON text)",
                                  param="messages")
        out.append({"id": str(call.get("id", f"call_{index}_{j}")), "type": "function",
                    "function": {"name": name, "arguments": _arguments_value(arguments)}})
    return out


def tool_turn(message: ChatMessage, index: int, item: dict[str, Any], rendering: ToolRendering) -> dict[str, Any]:
    """A template message dict (`item`, its text content made) with the turn's tool calls or tool result."""
    if message.role == "tool":
        if not message.tool_call_id:
            raise invalid_request(f"Missing required parameter: 'messages[{index}].tool_call_id'", param="messages",
                                  code="missing_required_parameter")
        if rendering.native_calls or rendering.native_tools:
            return {**item, "tool_call_id": message.tool_call_id}
        return {**item, "role": "user", "content": rendering.format.render_result(item["content"])}
    if message.tool_call_id is not None:
        raise invalid_request(f"'messages[{index}].tool_call_id' belongs to a 'tool' message", param="messages")
    if not message.tool_calls:
        return item
    if message.role != "assistant":
        raise invalid_request(f"'messages[{index}].tool_calls' belongs to an 'assistant' message", param="messages")
    calls = _calls(message, index)
    if rendering.native_calls:
        return {**item, "tool_calls": calls}
    written = rendering.format.render_calls([c["function"] for c in calls])
    return {**item, "content": f"{item['content']}\n{written}" if item["content"] else written}


def with_tools_prompt(msgs: list[dict[str, Any]], rendering: ToolRendering) -> list[dict[str, Any]]:
    """The tools as the first system message's text, for a template that ignores `tools`."""
    if not rendering.tools or rendering.native_tools:
        return msgs
    prompt = rendering.format.system_prompt(rendering.tools)
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": f"{msgs[0]['content']}\n\n{prompt}"}, *msgs[1:]]
    return [{"role": "system", "content": prompt}, *msgs]
