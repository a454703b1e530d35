"""Tools through the three real processes (the embedded SmolLM2 on the CPU), with the official openai SDK: a named
tool_choice and `required` give calls whose arguments validate against the function's schema (streamed deltas
assemble into the same JSON), a tool-result round trip puts the call and its result into the prompt (read back
through /tokenize) and gets a plain answer, and bad tools are 400s naming the field. SmolLM2's template ignores
`tools`: they reach it as a Hermes system prompt (see infer_server/tools.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest

from tests.e2e.cluster import ServedCluster

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "units"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(smol_cluster: ServedCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smol_cluster.url}/v1", api_key="x", max_retries=0, timeout=180) as c:
        yield c


def _valid(name: str, arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], value)
    return value


def test_a_named_tool_choice_gives_a_valid_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and len(calls) == 1 and choice.message.content is None
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


def test_sdk_parse_with_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    """The SDK's strict tool (additionalProperties false) parsed back into the pydantic model."""
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse  # newer SDKs: out of beta
    resp = parse(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                 tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = resp.choices[0].message.tool_calls or []
    assert len(calls) == 1 and isinstance(calls[0].function.parsed_arguments, Weather)


def test_required_gives_valid_calls(client: openai.OpenAI) -> None:
    """Sampled, parallel calls allowed (the streamed test below forces a single one)."""
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=11, max_tokens=120)
    choice = resp.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and calls
    for call in calls:
        _valid(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def test_streamed_tool_call_deltas_assemble_into_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0.7, seed=4, max_tokens=120, stream=True,
                                            parallel_tool_calls=False, logprobs=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict[str, str]] = {}
    reasons, fragments, logprobs, usage = [], 0, 0, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        logprobs += len(chunk.choices[0].logprobs.content or []) if chunk.choices[0].logprobs else 0
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            if part.id is not None:  # the first delta of a call: id, type and name, then argument fragments only
                assert part.index not in calls and part.type == "function" and part.function.name
                calls[part.index] = {"name": part.function.name, "arguments": part.function.arguments or ""}
            else:
                assert part.function.name is None
                calls[part.index]["arguments"] += part.function.arguments or ""
                fragments += 1
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0] and fragments > 1
    # every token's logprob rides on some chunk, text the parser held back included (the stop token's aside)
    assert usage is not None and logprobs in (usage.completion_tokens - 1, usage.completion_tokens)
    _valid(calls[0]["name"], calls[0]["arguments"])


def _tokenize(cluster: ServedCluster, messages: list[Any]) -> dict[str, Any]:
    r = httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tool_result_round_trip(client: openai.OpenAI, smol_cluster: ServedCluster) -> None:
    """The call and its result reach the prompt the model answers from, and the answer is a plain message."""
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert first.finish_reason == "tool_calls"
    call = (first.message.tool_calls or [])[0]
    arguments = _valid("get_weather", call.function.arguments)
    result = '{"forecast": "sunny, 24 C"}'
    history: list[Any] = [*ASK, first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=30)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # /tokenize renders a history as the chat request does (the same template, the tool turns in the same words;
    # SmolLM2's template knows neither: the call is written into the assistant's turn, the result is a user turn),
    # only without the tools' system prompt ...
    seen = _tokenize(smol_cluster, history)
    text = httpx.post(f"{smol_cluster.url}/detokenize", json={"model": MODEL, "tokens": seen["tokens"]},
                      timeout=60).json()["prompt"]
    written = re.findall(r"<\|im_start\|>assistant\n<tool_call>\n(.*?)\n</tool_call><\|im_end\|>", text, re.S)
    assert [json.loads(c) for c in written] == [{"name": "get_weather", "arguments": arguments}]
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # the result is the last turn: the model answers it
    # ... which is what the question alone adds to its prompt: so the answer's prompt is exactly that history
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    tools_prompt = (plain.usage.prompt_tokens if plain.usage else 0) - _tokenize(smol_cluster, ASK)["count"]
    assert tools_prompt > 100  # the two tools' signatures
    assert answer.usage and answer.usage.prompt_tokens == seen["count"] + tools_prompt


def test_tools_on_offer_without_a_call_stay_content(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


@pytest.mark.parametrize("fields,param,problem", [
    ({"tools": [{"type": "retrieval"}]}, "tools", "must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]}, "tools",
     "tools[0].function.parameters.type must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto'"),
])
def test_bad_tools_are_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any], param: str,
                                            problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and problem in error["message"]


def test_a_tool_schema_the_grammar_engine_refuses_is_400_naming_tool_choice(client: openai.OpenAI) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}, "required": ["a"]}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=bad, tool_choice="required")
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice" and error["code"] == "invalid_grammar"
