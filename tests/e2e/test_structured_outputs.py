"""response_format through the three real processes (the embedded SmolLM2 on the CPU), with the official openai
SDK: json_schema outputs parse and validate (greedy and sampled, streamed and not, chat and completions), a row cut
by max_tokens ends with "length", the SDK's `parse` with a pydantic model, json_object, refusals, and free requests
next to constrained ones keep their tokens. Small schemas and short max_tokens keep each request to seconds on a
loaded CPU; constrained rows ride every step of the one-step-ahead pipeline (see docs/architecture.md)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema_rs
import openai
import pydantic
import pytest

from tests.e2e.cluster import ServedCluster

MODEL = "SmolLM2-135M-Instruct"
PERSON = [{"role": "user", "content": "Describe a fictional person as JSON: age, mood, tags and address."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                      "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["city", "zip"]},
    },
    "required": ["age", "mood", "tags", "address"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(smol_cluster: ServedCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smol_cluster.url}/v1", api_key="x", max_retries=0, timeout=180) as c:
        yield c


def test_json_schema_chat_validates(client: openai.OpenAI) -> None:
    """Greedy, streamed and not (the same text); sampled in the tests below (each of these costs a few seconds on a
    loaded CI core)."""
    resp = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=0, seed=7,
                                          max_tokens=80, response_format=FORMAT)  # type: ignore[arg-type]
    choice = resp.choices[0]
    jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content or ""))
    assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=0, seed=7, max_tokens=80,
                                            response_format=FORMAT, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_json_schema_sampled_choices_validate(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=1.0, seed=9, n=2,
                                          max_tokens=80, response_format=FORMAT)  # type: ignore[arg-type]
    for choice in resp.choices:
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content or ""))
        assert choice.finish_reason == "stop"


def test_json_schema_streamed_matches_and_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=0.8, seed=3, max_tokens=80,
                                            response_format=FORMAT, stream=True)  # type: ignore[arg-type]
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema_rs.validate(SCHEMA, json.loads(text))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_json_schema_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="A person as JSON:", temperature=0, max_tokens=80,
                                     extra_body={"response_format": FORMAT})
    jsonschema_rs.validate(SCHEMA, json.loads(resp.choices[0].text))
    assert resp.choices[0].finish_reason == "stop"


def test_json_schema_completions_streamed_validates(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="A person as JSON:", temperature=0.8, seed=6,
                                       max_tokens=80, stream=True, extra_body={"response_format": FORMAT})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].text for c in chunks)
    jsonschema_rs.validate(SCHEMA, json.loads(text))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_a_constrained_row_cut_by_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    """Too few tokens for any document of the schema: the grammar never completes, max_tokens ends the row with
    "length" after exactly max_tokens tokens (the text a prefix of a document), streamed or not."""
    resp = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=0, max_tokens=5,
                                          response_format=FORMAT)  # type: ignore[arg-type]
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage and resp.usage.completion_tokens == 5
    text = choice.message.content or ""
    assert text.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(text)
    stream = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=0, max_tokens=5,
                                            response_format=FORMAT, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 5


class Address(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    zip: int = pydantic.Field(ge=0, le=999)


class Person(pydantic.BaseModel):
    age: int = pydantic.Field(ge=18, le=99)
    mood: Literal["happy", "sad"]
    address: Address


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse  # newer SDKs: out of beta
    resp = parse(model=MODEL, messages=PERSON, temperature=0, max_tokens=80, response_format=Person)
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person) and 18 <= person.age <= 99


def test_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object like {"answer": "Paris"}: capital of France?'}])
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # a free-form object may run past max_tokens: then it is cut, and only then
        assert choice.finish_reason == "length" and (choice.message.content or "").startswith("{")


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}}}


def test_free_requests_next_to_constrained_ones_keep_their_tokens(client: openai.OpenAI) -> None:
    """Constrained rows of every kind (a schema, a regex, a forced tool call) batched with free ones."""
    free = {"model": MODEL, "messages": PERSON, "temperature": 0, "max_tokens": 24}
    alone = client.chat.completions.create(**free).choices[0].message.content  # type: ignore[call-overload]
    sampled = {**free, "temperature": 1.0}
    with ThreadPoolExecutor(5) as pool:
        constrained = [
            pool.submit(client.chat.completions.create, **sampled, response_format=FORMAT, seed=1),  # type: ignore
            pool.submit(client.chat.completions.create, **sampled, seed=2,  # type: ignore[call-overload]
                        extra_body={"structured_outputs": {"regex": "[a-z]{3,9}"}}),
            pool.submit(client.chat.completions.create, **sampled, seed=3, tools=[TOOL],  # type: ignore
                        tool_choice="required"),
        ]
        mixed = [pool.submit(client.chat.completions.create, **free) for _ in range(2)]  # type: ignore[call-overload]
        # (24 tokens may cut the object: only the free rows are compared)
        assert re.fullmatch("[a-z]{3,9}", constrained[1].result().choices[0].message.content or "")
        assert constrained[2].result().choices[0].message.tool_calls
        constrained[0].result()
        assert [f.result().choices[0].message.content for f in mixed] == [alone, alone]


@pytest.mark.parametrize("response_format,field", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "type must be one of"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 3, "maxItems": 1}}},
     "exceeds maxItems"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "type"),
])
def test_invalid_formats_are_400(client: openai.OpenAI, response_format: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=4,
                                       response_format=response_format)  # type: ignore[arg-type]


def test_a_schema_the_grammar_engine_refuses_is_400(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError, match="grammar engine"):
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=4,
                                       response_format=bad)  # type: ignore[arg-type]


def test_structured_outputs_regex_and_choice(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give a phone number."}]
    regex = client.chat.completions.create(model=MODEL, messages=ask, temperature=0.9, seed=1, max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": r"\+33 [1-9]( [0-9]{2}){4}"}})
    assert re.fullmatch(r"\+33 [1-9]( [0-9]{2}){4}", regex.choices[0].message.content or "")
    assert regex.choices[0].finish_reason == "stop"
    choices = ["Paris", "Rome", 'the "big" apple']
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert picked.choices[0].text in choices


def test_structured_outputs_ebnf_grammar_streamed(client: openai.OpenAI) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    stream = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=1.0, seed=5, max_tokens=20,
                                            stream=True, extra_body={"structured_outputs": {"grammar": grammar}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("structured_outputs,problem", [
    ({"regex": "(("}, "parenthesis is not closed"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
])
def test_a_regex_or_grammar_the_engine_refuses_is_400_naming_it(client: openai.OpenAI, structured_outputs: dict,
                                                                 problem: str) -> None:
    with pytest.raises(openai.BadRequestError, match=problem) as info:
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=4,
                                       extra_body={"structured_outputs": structured_outputs})
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "structured_outputs" and error["code"] == "invalid_grammar"


@pytest.mark.parametrize("fields,param", [
    ({"stop": ["}"]}, "stop"),
    ({"extra_body": {"allowed_token_ids": [90]}}, "allowed_token_ids"),
])
def test_a_grammar_with_a_stop_string_or_allowed_token_ids_is_400(client: openai.OpenAI, fields: dict,
                                                                  param: str) -> None:
    """A stop string could cut the document; the allowed tokens could leave the grammar nothing to sample."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=4,  # type: ignore[call-overload]
                                       response_format=FORMAT, **fields)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert "cannot be combined with 'response_format'" in error["message"]
