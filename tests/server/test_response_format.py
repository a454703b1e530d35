"""response_format in the server: what it sends the worker (kind + canonical schema text) and what it refuses with a
400 naming the problem (the worker's grammar engine is tested in tests/worker/test_structured_output.py); through the
HTTP server and the fake scheduler, the fields a grammar cannot be combined with and the worker's grammar_too_complex
as a client sees it, streamed and not."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infer_protocol.messages import RequestError, StructuredOutput, Submit
from infer_server.errors import ApiError
from infer_server.openai_models import ChatCompletionRequest, CompletionRequest
from infer_server.params import MAX_SCHEMA_CHARS, choice_grammar, request_grammar, structured_output
from infer_server.tokenizer import Tokenizer
from tests.server.conftest import ServerHarness
from tests.server.fake_scheduler import Reply
from tests.server.sse_util import chat_text, completion_text, parse_sse


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


# ------------------------------------------------------------------ through the HTTP server (the fake scheduler)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
# Every way a request gets a grammar, on the endpoints that have it: (endpoint, fields, the field named in errors).
GRAMMARS = {
    "json_object": ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    "json_schema": ("/v1/completions", {"response_format": _schema({"type": "object", "properties": {
        "a": {"type": "integer"}}})}, "response_format"),
    "structured_outputs": ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    "completions_structured_outputs": ("/v1/completions", {"structured_outputs": {"choice": ["a", "b"]}},
                                       "structured_outputs"),
    "required": ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    "named": ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
              "tool_choice"),
}
GRAMMAR_TIMEOUT = "the grammar did not compile within 30 s"  # the worker's message (structured_output._sync)


@pytest.fixture(scope="module")
def grammar_server(model_dir: Path, tokenizer: Tokenizer) -> Iterator[ServerHarness]:
    """The fake scheduler with room for the tools' system prompt. A request with a grammar and COMPLEX in its prompt
    is answered as the real scheduler answers one whose grammar missed the worker's compile deadline: a
    RequestError `grammar_too_complex` (400), before any token. Every other request runs as usual."""
    h = ServerHarness(model_dir, tokenizer, start_scheduler=False)
    h.fake.max_model_len = 4096
    usual = h.fake.responder

    def respond(sub: Submit) -> Reply:
        if sub.sampling.structured is None or "COMPLEX" not in tokenizer.decode(sub.prompt_token_ids):
            return usual(sub)
        return Reply([], 0, error=RequestError(sub.request_id, code="grammar_too_complex", message=GRAMMAR_TIMEOUT,
                                               status=400))

    h.fake.responder = respond
    h.start_scheduler()
    h.wait_ready()
    yield h
    h.stop()


def _body(path: str, fields: dict[str, Any], text: str = "hi") -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    return {**prompt, "max_tokens": 8, **fields}


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("fields,param,why", [
    ({"stop": "}"}, "stop", "a stop string could cut the structured output"),
    ({"stop": ["x", ","]}, "stop", "a stop string could cut the structured output"),
    ({"allowed_token_ids": [5, 6]}, "allowed_token_ids", "could have nothing in common"),
])
def test_a_grammar_with_a_stop_string_or_allowed_token_ids_is_400(grammar_server: ServerHarness, grammar: str,
                                                                  fields: dict[str, Any], param: str,
                                                                  why: str) -> None:
    """A stop string would end the output where it matches, mid-document, with finish_reason "stop"; the allowed
    tokens and the grammar's could leave nothing to sample: both refused before the scheduler sees the request."""
    path, grammar_fields, grammar_param = GRAMMARS[grammar]
    submitted = len(grammar_server.fake.submits)
    r = grammar_server.http.post(path, json=_body(path, {**grammar_fields, **fields}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["code"] == "unsupported_parameter"
    assert f"'{param}' cannot be combined with '{grammar_param}'" in error["message"] and why in error["message"]
    assert len(grammar_server.fake.submits) == submitted


@pytest.mark.parametrize("path,fields", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "stop": []}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "stop": ""}),  # matches nothing
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "stop": "}", "allowed_token_ids": [5, 6]}),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "auto", "stop": "}"}),  # no grammar
    ("/v1/completions", {"structured_outputs": {"regex": "[a-z]+"}, "stop_token_ids": [7]}),
])
def test_what_a_grammar_still_combines_with(grammar_server: ServerHarness, path: str, fields: dict[str, Any]) -> None:
    """stop_token_ids are the grammar's stop tokens (the worker's matcher refuses them until the output is
    complete, as EOS): they cannot cut it, so they stay accepted and reach the scheduler."""
    r = grammar_server.http.post(path, json=_body(path, fields))
    assert r.status_code == 200, r.text
    if "stop_token_ids" in fields:
        assert grammar_server.fake.submit_for(r.json()["id"]).stop_token_ids[0] == 7


@pytest.mark.parametrize("grammar", ["json_object", "json_schema", "structured_outputs", "named"])
def test_grammar_too_complex_is_400_naming_the_field(grammar_server: ServerHarness, grammar: str) -> None:
    path, fields, param = GRAMMARS[grammar]
    r = grammar_server.http.post(path, json=_body(path, fields, "COMPLEX"))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"'{param}': {GRAMMAR_TIMEOUT}", "type": "invalid_request_error",
                                 "param": param, "code": "grammar_too_complex"}
    # the same grammar on another prompt is served (only that request failed)
    assert grammar_server.http.post(path, json=_body(path, fields)).status_code == 200


@pytest.mark.parametrize("grammar", ["json_object", "completions_structured_outputs", "required"])
def test_grammar_too_complex_streamed_is_an_error_event_then_done(grammar_server: ServerHarness,
                                                                  grammar: str) -> None:
    path, fields, param = GRAMMARS[grammar]
    body = _body(path, {**fields, "stream": True}, "COMPLEX")
    with grammar_server.http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200  # (sent before the scheduler answered)
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(resp.iter_lines())
    assert events[-2] == {"error": {"message": f"'{param}': {GRAMMAR_TIMEOUT}", "type": "invalid_request_error",
                                    "param": param, "code": "grammar_too_complex"}}
    assert events[-1] == "[DONE]"
    before = events[:-2]
    assert (chat_text(before) if "chat" in path else completion_text(before)) == ""  # no token came
    assert not [c for e in before for c in e.get("choices", []) if c.get("finish_reason")]
