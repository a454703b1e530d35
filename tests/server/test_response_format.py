"""response_format in the server: what it sends the worker (kind + canonical schema text) and what it refuses with a
400 naming the problem (the worker's grammar engine is tested in tests/worker/test_structured_output.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from infer_protocol.messages import StructuredOutput
from infer_server.errors import ApiError
from infer_server.openai_models import ChatCompletionRequest, CompletionRequest
from infer_server.params import MAX_SCHEMA_CHARS, choice_grammar, request_grammar, structured_output


def _chat(response_format: Any, **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format, **fields})


def _spec(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    return structured_output(req.response_format, req)


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


def test_what_travels_to_the_worker() -> None:
    assert _spec(_chat({"type": "text"})) is None and _spec(_chat(None)) is None
    assert _spec(_chat({"type": "json_object"})) == StructuredOutput(kind="json_object")
    # sorted keys, compact: equal schemas written differently share one compilation in the worker
    a = _spec(_chat(_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": [1]}}})))
    b = _spec(_chat(_schema({"properties": {"a": {"enum": [1]}, "b": {"type": "integer"}}, "type": "object"})))
    assert a == b == StructuredOutput(
        kind="json_schema", schema='{"properties":{"a":{"enum":[1]},"b":{"type":"integer"}},"type":"object"}')
    assert _spec(_chat({"type": "json_schema", "json_schema": {"name": "s"}})) == StructuredOutput(kind="json_object")
    completion = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert _spec(completion) == StructuredOutput(kind="json_object")


@pytest.mark.parametrize("schema,message", [
    ({"type": "strng"}, "schema.type must be one of"),
    ({"type": "object", "properties": {"a": {"type": ["integer", "nope"]}}}, "schema.properties.a.type"),
    ({"type": "object", "properties": []}, "properties must be an object"),
    ({"anyOf": []}, "anyOf must be a non-empty array"),
    ({"type": "object", "required": "a"}, "required must be an array of strings"),
    ({"enum": []}, "enum must be a non-empty array"),
    ({"type": "array", "items": {"type": "string", "maxLength": -1}}, "schema.items.maxLength must be a non-negative"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) exceeds maximum (1)"),
    ({"type": "array", "items": 3}, "schema.items must be a JSON Schema"),
    ({"enum": ["x" * MAX_SCHEMA_CHARS]}, "at most"),
])
def test_broken_schemas_are_400(schema: Any, message: str) -> None:
    with pytest.raises(ApiError, match=re.escape(message)) as info:
        _spec(_chat(_schema(schema)))
    assert info.value.status == 400


@pytest.mark.parametrize("response_format,fields,message", [
    ({"type": "json_schema"}, {}, "Missing required parameter"),
    ({"type": "json_object", "json_schema": {"name": "s"}}, {}, "needs type 'json_schema'"),
    ({"type": "json_object"}, {"ignore_eos": True}, "ignore_eos"),
    ({"type": "json_object"}, {"min_tokens": 2}, "min_tokens"),
])
def test_refused_combinations(response_format: Any, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError, match=message):
        _spec(_chat(response_format, **fields))


@pytest.mark.parametrize("response_format", [
    {"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "has space"}}, {"type": "json_object", "x": 1},
    "json_object",
])
def test_malformed_formats_fail_validation(response_format: Any) -> None:
    with pytest.raises(ValueError):
        _chat(response_format)


def _so(structured_outputs: Any, **fields: Any) -> StructuredOutput | None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": structured_outputs, **fields})
    grammar = request_grammar(req)
    return None if grammar is None else grammar.spec


def test_structured_outputs_travel_as_regex_ebnf_or_schema() -> None:
    assert _so({"regex": "[a-z]+"}) == StructuredOutput(kind="regex", schema="[a-z]+")
    assert _so({"grammar": 'root ::= "a"'}) == StructuredOutput(kind="grammar", schema='root ::= "a"')
    assert _so({"json": {"type": "integer"}}) == _so({"json": '{"type": "integer"}'}) == StructuredOutput(
        kind="json_schema", schema='{"type":"integer"}')
    assert _so({"json_object": True}) == StructuredOutput(kind="json_object")
    assert _so(None) is None


def test_choice_becomes_an_ebnf_of_json_literals() -> None:
    spec = _so({"choice": ["yes", 'say "no"', "é\n"]})
    assert spec == StructuredOutput(kind="grammar", schema='root ::= "yes" | "say \\"no\\"" | "é\\n"')
    assert choice_grammar(["a"]) == 'root ::= "a"'


@pytest.mark.parametrize("structured_outputs,fields,message", [
    ({}, {}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, {}, "exactly one of"),
    ({"choice": []}, {}, "structured_outputs.choice' must not be empty"),
    ({"regex": ""}, {}, "structured_outputs.regex' must not be empty"),
    ({"json": "{not json"}, {}, "structured_outputs.json' is not JSON"),
    ({"json": {"type": "strng"}}, {}, "structured_outputs.json.type must be one of"),
    ({"regex": "a"}, {"ignore_eos": True}, "ignore_eos"),
    ({"regex": "a"}, {"response_format": {"type": "json_object"}}, "cannot both"),
])
def test_structured_outputs_refusals_name_the_field(structured_outputs: Any, fields: dict[str, Any],
                                                    message: str) -> None:
    with pytest.raises(ApiError, match=re.escape(message)) as info:
        _so(structured_outputs, **fields)
    assert info.value.status == 400 and info.value.param in ("structured_outputs", "ignore_eos")


def test_an_unknown_structured_outputs_key_fails_validation() -> None:
    with pytest.raises(ValueError):
        _so({"regexp": "a"})
