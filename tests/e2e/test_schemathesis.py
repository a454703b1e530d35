"""schemathesis against the running server's own OpenAPI schema (`/openapi.json`): whatever it generates,
schema-valid or not, for the POST endpoints, the answer is never a 5xx, and a stream never ends with a
server error event.

- Bounded: on the tiny checkpoint (context 256) `max_tokens` / `max_completion_tokens` are capped at 4 (set
  when omitted), `min_tokens` at 4 and `n` at 2, so no generated request can stall the run.
- Deep: a request the schema allows is still mostly refused by the server's own rules (a tool message, a
  token id outside the vocabulary, the wrong model name, ...). So each positive case is sent at one of three
  levels: `raw` (as generated), `shaped` (those refusals repaired: served model name, token ids folded into
  the vocabulary, tool messages turned into user messages, ...), or `core` (shaped, and only the fields every
  OpenAI client sends). Each positive operation must reach a 200 several times.
- Reproducible: examples are derandomized, a failure shows again on the next run.
"""

from __future__ import annotations

import collections
import json
import math
import re
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.e2e.cluster import ServedCluster

MODEL = "tiny"
VOCAB = 49152
GENERATION = ("/v1/chat/completions", "/v1/completions")
OPERATIONS = (*GENERATION, "/tokenize", "/detokenize")
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 2}
CORE = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "n", "stream", "stream_options", "ignore_eos", "min_tokens",
    "skip_special_tokens", "return_token_ids", "user", "add_generation_prompt", "tokens", "add_special_tokens",
}
# refused with a 400 whatever their value (or any value but a neutral one), or (response_format, structured_outputs,
# tools) a grammar compiled per case, too dear to fuzz (tests/server/test_response_format.py and test_tool_calls.py
# cover their 400s): `shaped` drops them
REFUSED = {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
           "structured_outputs", "suffix", "best_of"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bound(body: dict[str, Any], path: str) -> None:
    """Keep the case cheap: cap token counts and n (ints only: a wrongly typed value stays wrong)."""
    for key, cap in CAPS.items():
        if _is_int(body.get(key)) and body[key] > cap:
            body[key] = cap
    # null is "omitted" too: chat then generates to the end of the context (n=2 x 250 tokens, a minute on a loaded CPU)
    if path in GENERATION and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]


def _fold(ids: Any) -> Any:
    return [abs(t) % VOCAB for t in ids] if isinstance(ids, list) and all(_is_int(t) for t in ids) else ids


def _shape_message(message: Any) -> None:
    if not isinstance(message, dict):
        return
    if message.get("role") == "tool":
        message["role"] = "user"
    message.pop("tool_calls", None)
    message.pop("tool_call_id", None)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [{"type": "text", "text": p.get("text") if isinstance(p.get("text"), str) else "hi"}
                              for p in content if isinstance(p, dict)] or "hi"


def _shape(body: dict[str, Any], path: str, level: str) -> None:
    """Repair what the server refuses by its own rules, so the request reaches tokenization and generation."""
    if level == "core":
        for key in set(body) - CORE:
            del body[key]
    for key in REFUSED & set(body):
        del body[key]
    body["model"] = MODEL
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    else:
        body.pop("return_token_ids", None)
    for key in ("stop_token_ids", "tokens"):
        if key in body:
            body[key] = _fold(body[key])
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(abs(int(k)) % VOCAB): max(-100.0, min(100.0, v))
                              for k, v in body["logit_bias"].items()
                              if re.fullmatch(r"-?[0-9]{1,18}", k) and isinstance(v, (int, float)) and math.isfinite(v)}
    for message in body.get("messages") or []:
        _shape_message(message)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = [prompt[0]]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[:1]
    if isinstance(prompt, list) and prompt and _is_int(prompt[0]):
        prompt = _fold(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = [_fold(prompt[0]) or [1]]
    if prompt in ("", [], [""]):
        prompt = "hello"
    if "prompt" in body or path == "/v1/completions":
        body["prompt"] = prompt if prompt is not None else "hello"
    if path == "/tokenize" and ("prompt" in body) == ("messages" in body):
        body.pop("messages", None)
        body.setdefault("prompt", "hello")
    if _is_int(body.get("min_tokens")):
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or CAPS["max_tokens"]
        body["min_tokens"] = min(body["min_tokens"], limit if _is_int(limit) else 0)


def _server_errors_in_stream(text: str) -> list[Any]:
    found = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                event = json.loads(line[6:])
            except ValueError:
                found.append(f"undecodable event: {line[:200]}")
                continue
            if isinstance(event, dict) and "error" in event and event["error"].get("type") == "server_error":
                found.append(event)
    return found


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
@pytest.mark.parametrize("path", OPERATIONS)
def test_no_server_error_on_generated_input(tiny_cluster: ServedCluster, path: str, mode: GenerationMode) -> None:
    url = tiny_cluster.url
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operation = schema[path]["POST"]
    failures: list[str] = []
    statuses: collections.Counter[int] = collections.Counter()
    levels = ["raw", "shaped", "core"] if mode.is_positive else ["raw"]

    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), level=st.sampled_from(levels))
    def run(case: schemathesis.Case, level: str) -> None:
        if isinstance(case.body, dict):
            if level != "raw":
                _shape(case.body, path, level)
            _bound(case.body, path)
        try:
            response = case.call(base_url=url, timeout=60)
        except Exception as exc:  # a reset connection or a hang (timeout) is as bad as a 5xx
            failures.append(f"{type(exc).__name__}: {exc} for body {case.body!r}")
            return
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]} for body {case.body!r}")
        elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            for event in _server_errors_in_stream(response.text):
                failures.append(f"server error event {event} for body {case.body!r}")

    run()
    print(f"{path} {mode.value}: {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    if mode.is_positive:
        assert statuses[200] >= 5, f"the fuzzer hardly got past validation: {dict(statuses)}"
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
