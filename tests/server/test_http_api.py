"""The OpenAI API over real HTTP, the real app and DEALER client, and the fake scheduler over real ZMQ IPC."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from infer_server.tokenizer import Tokenizer
from tests.server.conftest import ANSWER, MAX_MODEL_LEN, ServerHarness
from tests.server.fake_scheduler import FAKE_PREFILL_TIME, FAKE_QUEUE_TIME, fake_cached_tokens
from tests.server.sse_util import chat_text, completion_text, parse_sse

USER = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_prompt_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False)


def _stream(server: ServerHarness, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with server.http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(resp.iter_lines())
    return resp, events


def _eos_ids(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]  # type: ignore[list-item]


# ------------------------------------------------------------------ chat


def test_chat_non_streaming(server: ServerHarness, tokenizer: Tokenizer) -> None:
    r = server.http.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": USER})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-chat"
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "logprobs": None,
                      "finish_reason": "stop"}
    prompt_ids = _chat_prompt_ids(tokenizer, USER)
    answer_len = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1  # + the EOS token
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": answer_len,
                             "total_tokens": len(prompt_ids) + answer_len,
                             "prompt_tokens_details": {"cached_tokens": fake_cached_tokens(len(prompt_ids))}}
    sub = server.fake.submit_for(body["id"])
    assert sub.prompt_token_ids == prompt_ids
    assert sub.max_tokens == MAX_MODEL_LEN - len(prompt_ids)  # omitted = the rest of the context
    assert sub.stop_token_ids == _eos_ids(tokenizer)  # generation_config.json + config.json
    assert sub.sampling.temperature == 1.0 and sub.sampling.top_k == 0 and not sub.ignore_eos
    assert r.headers["x-request-id"]


def test_chat_random_seed_when_none_given(server: ServerHarness) -> None:
    ids = [server.http.post("/v1/chat/completions", json={"messages": USER}).json()["id"] for _ in range(2)]
    seeds = {server.fake.submit_for(i).sampling.seed for i in ids}
    assert len(seeds) == 2


def test_chat_streaming_exact_chunks_with_usage(server: ServerHarness, tokenizer: Tokenizer) -> None:
    _, events = _stream(server, "/v1/chat/completions",
                        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny-chat" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    content = chunks[1:-2]
    assert content and all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None
                           for c in content)
    # one chunk a generated token (the EOS shows none), as vLLM streams: a token whose text is held back (the
    # emoji's first bytes) gets an empty delta
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert len(content) == len(answer_ids)
    held = [k for k in range(1, len(answer_ids) + 1) if tokenizer.decode(answer_ids[:k]).endswith("\ufffd")]
    assert held and [k for k, c in enumerate(content, 1) if not c["choices"][0]["delta"]["content"]] == held
    assert chat_text(chunks) == ANSWER
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_len = len(_chat_prompt_ids(tokenizer, USER))
    completion = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": completion,
                                    "total_tokens": prompt_len + completion,
                                    "prompt_tokens_details": {"cached_tokens": fake_cached_tokens(prompt_len)}}
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: null usage on every other chunk


def test_chat_streaming_continuous_usage(server: ServerHarness, tokenizer: Tokenizer) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries the running usage; alone it reports nothing."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, events = _stream(server, "/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": options})
    chunks = events[:-1]
    prompt_len = len(_chat_prompt_ids(tokenizer, USER))
    completion = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    assert chat_text(chunks) == ANSWER and chunks[-1]["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == prompt_len
               and c["usage"]["total_tokens"] == prompt_len + c["usage"]["completion_tokens"] for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    content = chunks[1:-2]
    assert counts[0] == 0  # the role chunk
    assert counts[1:-2] == sorted(set(counts[1:-2])) and counts[-2:] == [completion, completion]  # + finish, usage
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    text = ""
    for chunk, count in zip(content, counts[1:-2]):  # each count covers exactly the text streamed so far
        text += chunk["choices"][0]["delta"]["content"]
        decoded = tokenizer.decode(answer_ids[:count])
        # a held-back token's chunk is empty: its text so far ends inside a character
        assert decoded == text if chunk["choices"][0]["delta"]["content"] else decoded.endswith("\ufffd")
    _, events = _stream(server, "/v1/chat/completions", {"messages": USER, "stream": True,
                                                          "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in e for e in events[:-1]) and chat_text(events) == ANSWER


def test_chat_streaming_without_usage(server: ServerHarness) -> None:
    _, events = _stream(server, "/v1/chat/completions", {"messages": USER, "stream": True})
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert chat_text(events) == ANSWER


def test_chat_sampling_fields_are_forwarded(server: ServerHarness, tokenizer: Tokenizer) -> None:
    r = server.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "LONG"}, {"type": "text", "text": "x"}]}],
        "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 42, "max_completion_tokens": 7,
        "stop_token_ids": [7], "ignore_eos": True, "min_tokens": 2, "user": "u1",
    })
    assert r.status_code == 200, r.text
    body = r.json()
    sub = server.fake.submit_for(body["id"])
    assert sub.sampling.temperature == 0.0 and sub.sampling.top_p == 0.9 and sub.sampling.top_k == 5
    assert sub.sampling.min_p == 0.05 and sub.sampling.seed == 42
    assert sub.max_tokens == 7 and sub.min_tokens == 2
    assert sub.ignore_eos and sub.stop_token_ids == [7]  # ignore_eos: no EOS ids, only the client's
    assert tokenizer.decode(sub.prompt_token_ids).startswith("user\nLONG\nx")  # text parts joined
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7


def test_top_k_minus_one_is_off(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "top_k": -1, "max_tokens": 3})
    assert server.fake.submit_for(r.json()["id"]).sampling.top_k == 0


def test_chat_n_choices(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == ANSWER for c in body["choices"])
    subs = [server.fake.submit_for(f"{body['id']}-{i}") for i in range(3)]
    assert [s.sampling.seed for s in subs] == [5, 6, 7]
    assert body["usage"]["completion_tokens"] == 3 * (body["usage"]["completion_tokens"] // 3)
    assert body["usage"]["prompt_tokens"] == len(subs[0].prompt_token_ids)


def test_chat_n_choices_streaming(server: ServerHarness) -> None:
    _, events = _stream(server, "/v1/chat/completions", {"messages": USER, "n": 2, "stream": True})
    assert events[-1] == "[DONE]"
    for i in range(2):
        mine = [c for e in events[:-1] for c in e["choices"] if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == ANSWER
        assert mine[-1]["finish_reason"] == "stop"


# ------------------------------------------------------------------ completions


def test_completion_non_streaming(server: ServerHarness, tokenizer: Tokenizer) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": ANSWER, "logprobs": None, "finish_reason": "stop"}]
    prompt_ids = tokenizer.encode("The capital of France is")
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert server.fake.submit_for(body["id"]).prompt_token_ids == prompt_ids


def test_completion_streaming(server: ServerHarness) -> None:
    _, events = _stream(server, "/v1/completions",
                        {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[0]["choices"][0]["text"]  # no role chunk for completions
    assert completion_text(chunks) == ANSWER
    assert chunks[-2]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("wrap", [lambda ids: ids, lambda ids: [ids]])
def test_completion_token_id_prompt(server: ServerHarness, tokenizer: Tokenizer, wrap: Any) -> None:
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    r = server.http.post("/v1/completions", json={"prompt": wrap(ids), "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert server.fake.submit_for(body["id"]).prompt_token_ids == ids
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_completion_single_string_in_list(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": ["Hi"], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("kind", ["strings", "token lists"])
def test_completion_batched_prompts(server: ServerHarness, tokenizer: Tokenizer, kind: str) -> None:
    """OpenAI's list of prompts: choices prompt-major (index = prompt * n + choice), each prompt with the seeds a
    request of its own would get, usage counting each prompt once."""
    texts = ["Hi", "The capital of France is", "Once"]
    ids = [tokenizer.encode(t) for t in texts]
    prompt: Any = texts if kind == "strings" else ids
    r = server.http.post("/v1/completions", json={"prompt": prompt, "n": 2, "seed": 40, "max_tokens": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert all(c["text"] == ANSWER and c["finish_reason"] == "stop" for c in body["choices"])
    subs = server.fake.submits[-6:]
    assert [s.prompt_token_ids for s in subs] == [p for p in ids for _ in range(2)]
    assert [s.sampling.seed for s in subs] == [40, 41] * 3
    answer_tokens = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 6 * answer_tokens,
                             "total_tokens": sum(map(len, ids)) + 6 * answer_tokens,  # each prompt's hit once:
                             "prompt_tokens_details": {"cached_tokens": sum(fake_cached_tokens(len(i)) for i in ids)}}
    # echo puts each choice's own prompt before it, streamed or not
    r = server.http.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 30})
    echoed = [t if kind == "strings" else tokenizer.decode(i) for t, i in zip(texts, ids)]
    assert [c["text"] for c in r.json()["choices"]] == [e + ANSWER for e in echoed]
    _, events = _stream(server, "/v1/completions", {"prompt": prompt, "echo": True, "stream": True, "max_tokens": 30,
                                                    "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    for i, e in enumerate(echoed):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["choices"][0]["text"] == e and completion_text(mine) == e + ANSWER
        assert mine[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))


# ------------------------------------------------------------------ stop strings


def test_stop_string_non_streaming_aborts(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "stop": "capital"})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Hello world! 🙂 The "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert server.fake.wait_for(lambda: body["id"] in server.fake.aborts)


def test_stop_string_across_tokens_streaming(server: ServerHarness, tokenizer: Tokenizer) -> None:
    # " is Pa" starts inside the token " is" and ends inside the token " Paris"
    assert tokenizer.encode(" is Paris", add_special_tokens=False) == [
        tokenizer.token_to_id("Ġis"), tokenizer.token_to_id("ĠParis")]
    _, events = _stream(server, "/v1/completions",
                        {"prompt": "q", "stream": True, "stop": ["nothing", " is Pa"]})
    text = completion_text(events[:-1])
    assert text == "Hello world! 🙂 The capital of France"
    assert all(" is" not in c["text"] for e in events[:-1] for c in e["choices"])  # held back, never emitted
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert server.fake.wait_for(lambda: events[0]["id"] in server.fake.aborts)


def test_include_stop_str_in_output(server: ServerHarness) -> None:
    body = {"messages": USER, "stop": ["nothing", "capital"], "include_stop_str_in_output": True}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == "Hello world! 🙂 The capital"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    _, events = _stream(server, "/v1/completions", {"prompt": "q", "stream": True, "stop": " is Pa",
                                                    "include_stop_str_in_output": True})
    assert completion_text(events[:-1]) == "Hello world! 🙂 The capital of France is Pa"


def test_stop_token_id_text_not_shown(server: ServerHarness, tokenizer: Tokenizer) -> None:
    paris = tokenizer.token_to_id("ĠParis")
    r = server.http.post("/v1/completions", json={"prompt": "q", "stop_token_ids": [paris]})
    body = r.json()
    assert body["choices"][0] == {"index": 0, "text": "Hello world! 🙂 The capital of France is", "logprobs": None,
                                  "finish_reason": "stop"}
    assert server.fake.submit_for(body["id"]).stop_token_ids[0] == paris


# ------------------------------------------------------------------ engine errors


def test_engine_error_non_streaming(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 3})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_failed"


def test_engine_error_streaming(server: ServerHarness) -> None:
    _, events = _stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}],
                                                         "stream": True})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["code"] == "engine_failed"
    assert events[-1] == "[DONE]"


# ------------------------------------------------------------------ bad input


def _bad_cases(tok: Tokenizer) -> list[tuple[str, str, Any, int, str, str | None]]:
    long_prompt = "Paris " * 200
    return [
        ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json", None),
        ("not an object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json", None),
        ("missing messages", "/v1/chat/completions", {"model": "tiny-chat"}, 400, "missing_required_parameter", "messages"),
        ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_value", "messages"),
        ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "missing_required_parameter", "prompt"),
        ("max_tokens 0", "/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
        ("negative temperature", "/v1/chat/completions", {"messages": USER, "temperature": -0.5}, 400, "invalid_value", "temperature"),
        ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
        ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": USER}, 404, "model_not_found", "model"),
        ("unknown model completions", "/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
        ("prompt too long", "/v1/completions", {"prompt": long_prompt}, 400, "context_length_exceeded", "prompt"),
        ("messages too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]},
         400, "context_length_exceeded", "messages"),
        ("prompt + max_tokens too long", "/v1/chat/completions", {"messages": USER, "max_tokens": MAX_MODEL_LEN},
         400, "context_length_exceeded", "max_tokens"),
        ("unknown field", "/v1/chat/completions", {"messages": USER, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
        ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
        ("top_logprobs too large", "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
        ("tools", "/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "missing_required_parameter", "tools"),
        ("penalty out of range", "/v1/chat/completions", {"messages": USER, "presence_penalty": 2.5}, 400, "invalid_value", "presence_penalty"),
        ("repetition_penalty 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_value", "repetition_penalty"),
        ("completion logprobs too large", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "invalid_value", "logprobs"),
        ("best_of", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "unsupported_parameter", "best_of"),
        ("too many stop strings", "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]},
         400, "invalid_value", "stop"),
        ("too many choices", "/v1/completions", {"prompt": ["a"] * 65, "n": 2}, 400, "invalid_value", "prompt"),
        ("one batched prompt outside vocab", "/v1/completions", {"prompt": [[1, 2], [3, 10**6]]},
         400, "invalid_value", "prompt"),
        ("one batched prompt too long", "/v1/completions", {"prompt": ["x", "x " * MAX_MODEL_LEN]},
         400, "context_length_exceeded", "prompt"),
        ("empty token prompt", "/v1/completions", {"prompt": []}, 400, "invalid_value", "prompt"),
        ("token id outside vocab", "/v1/completions", {"prompt": [1, 10**6]}, 400, "invalid_value", "prompt"),
        ("image part", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "unsupported_parameter", "messages[0].content[0]"),
        ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "messages"),
        ("stream_options without stream", "/v1/chat/completions",
         {"messages": USER, "stream_options": {"include_usage": True}}, 400, "invalid_value", "stream_options"),
        ("min_tokens > max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
         400, "invalid_value", "min_tokens"),
        ("n too large", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "invalid_value", "n"),
        ("logit_bias key not a token id", "/v1/completions", {"prompt": "x", "logit_bias": {"hello": 1}},
         400, "invalid_value", "logit_bias"),
        ("logit_bias key not canonical", "/v1/completions", {"prompt": "x", "logit_bias": {"007": 1}},
         400, "invalid_value", "logit_bias"),
        ("logit_bias negative id", "/v1/chat/completions", {"messages": USER, "logit_bias": {"-3": 1}},
         400, "invalid_value", "logit_bias"),
        ("logit_bias id outside vocab", "/v1/chat/completions", {"messages": USER, "logit_bias": {"1000000": 1}},
         400, "invalid_value", "logit_bias"),
        ("logit_bias value out of range", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 100.5}},
         400, "invalid_value", "logit_bias"),
        ("allowed_token_ids empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []},
         400, "invalid_value", "allowed_token_ids"),
        ("allowed_token_ids outside vocab", "/v1/completions", {"prompt": "x", "allowed_token_ids": [3, 10**6]},
         400, "invalid_value", "allowed_token_ids"),
        ("allowed_token_ids only stop tokens under min_tokens", "/v1/completions",
         {"prompt": "x", "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2, "max_tokens": 4},
         400, "invalid_value", "allowed_token_ids"),
        ("logit_bias too many entries", "/v1/completions",
         {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, 400, "invalid_value", "logit_bias"),
        ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
    ]


def _post(server: ServerHarness, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, json=body)


def _check_error(r: httpx.Response, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["code"] == code, err
    assert err["param"] == param, err
    return err


def test_bad_inputs_answer_openai_errors_and_neighbours_are_unaffected(server: ServerHarness, tokenizer: Tokenizer) -> None:
    # a long streaming request runs while every bad request is answered
    result: dict[str, Any] = {}

    def neighbour() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "SLOW", "max_tokens": 60, "stream": True}) as resp:
                result["events"] = parse_sse(resp.iter_lines())

    t = threading.Thread(target=neighbour)
    t.start()
    assert server.fake.wait_for(lambda: server.fake.num_running > 0)
    for name, path, body, status, code, param in _bad_cases(tokenizer):
        r = _post(server, path, body)
        try:
            _check_error(r, status, code, param)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from None
    assert t.is_alive()  # the neighbour really ran beside them
    t.join(30)
    events = result["events"]
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert completion_text(events[:-1]).startswith(ANSWER)


def test_context_length_message(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1000})
    msg = r.json()["error"]["message"]
    assert msg.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested ")
    r = server.http.post("/v1/completions", json={"prompt": "Paris " * 200})
    assert r.json()["error"]["message"].startswith("This model's maximum context length is 128 tokens. However, you requested 2")


def test_unknown_route_and_method_are_openai_errors(server: ServerHarness) -> None:
    _check_error(server.http.get("/v1/nothing"), 404, "not_found", None)
    _check_error(server.http.get("/v1/chat/completions"), 405, "method_not_allowed", None)


# ------------------------------------------------------------------ concurrency


def test_eight_concurrent_streams(server: ServerHarness) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
        body = {"messages": [{"role": "user", "content": f"question {i}"}], "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = parse_sse([line async for line in resp.aiter_lines()])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
        return events[0]["id"], chat_text(events)

    async def main() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(main())
    assert len({rid for rid, _ in results}) == 8
    assert all(text == ANSWER for _, text in results)


# ------------------------------------------------------------------ other endpoints


def test_models(server: ServerHarness, model_dir: Any) -> None:
    body = server.http.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "tiny-chat" and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == str(model_dir)
    assert server.http.get("/v1/models/tiny-chat").json()["id"] == "tiny-chat"
    assert server.http.get("/v1/models/other").status_code == 404


def test_health_ready(server: ServerHarness) -> None:
    assert server.http.get("/health").status_code == 200
    r = server.http.get("/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_tokenize_detokenize(server: ServerHarness, tokenizer: Tokenizer) -> None:
    r = server.http.post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    r = server.http.post("/tokenize", json={"messages": USER})
    assert r.json()["tokens"] == _chat_prompt_ids(tokenizer, USER)
    r = server.http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    _check_error(server.http.post("/tokenize", json={}), 400, "invalid_value", "prompt")
    _check_error(server.http.post("/detokenize", json={"tokens": [-1]}), 400, "invalid_value", "tokens")
    _check_error(server.http.post("/tokenize", json={"prompt": "x", "model": "zzz"}), 404, "model_not_found", "model")


def test_request_id_echo(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"x-request-id": "my-req-1"})
    assert r.headers["x-request-id"] == "my-req-1"
    r = server.http.get("/health")
    assert len(r.headers["x-request-id"]) == 32
    r = server.http.post("/v1/chat/completions", content=b"{", headers={"x-request-id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    with server.http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                            headers={"x-request-id": "s-1"}) as resp:
        assert resp.headers["x-request-id"] == "s-1"


def _histograms(text: str) -> dict[str, float]:
    """`name_sum` / `name_count` of every histogram in a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(text) if family.type == "histogram"
            for sample in family.samples if sample.name.endswith(("_sum", "_count"))}


def test_request_phase_histograms_take_the_schedulers_timings(server: ServerHarness) -> None:
    before = _histograms(server.http.get("/metrics").text)
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    after = _histograms(server.http.get("/metrics").text)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"rustinfer_request_{phase}_time_seconds_count") == 2, phase  # one per choice
    assert grew("rustinfer_request_queue_time_seconds_sum") == 2 * FAKE_QUEUE_TIME
    assert grew("rustinfer_request_prefill_time_seconds_sum") == 2 * FAKE_PREFILL_TIME
    decode = grew("rustinfer_request_decode_time_seconds_sum")
    assert decode > 0  # three more tokens a choice, each a step of the fake scheduler later
    assert grew("rustinfer_request_inference_time_seconds_sum") == pytest.approx(2 * FAKE_PREFILL_TIME + decode)
    # the TPOT is the decode time over the tokens after the first
    assert grew("rustinfer_time_per_output_token_seconds_sum") == pytest.approx(decode / 3)


def test_metrics_text(server: ServerHarness) -> None:
    server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in (
        "rustinfer_num_requests_running 3.0",
        "rustinfer_num_requests_waiting 2.0",
        "rustinfer_kv_cache_usage_ratio 0.25",
        "rustinfer_prefix_cache_queries_tokens_total 1000.0",
        "rustinfer_prefix_cache_hits_tokens_total 250.0",
        "rustinfer_num_preemptions_total 4.0",
        "rustinfer_worker_restarts_total 2.0",
        "rustinfer_scheduler_plans_held_total 7.0",
        "rustinfer_scheduler_plans_held_past_step_end_total 1.0",
        "rustinfer_scheduler_ready 1.0",
    ):
        assert line in text, line
    assert 'rustinfer_request_success_total{endpoint="/v1/completions",finish_reason="length"}' in text
    assert 'rustinfer_http_requests_total{endpoint="/v1/completions",method="POST",status="200"}' in text
    assert "rustinfer_time_to_first_token_seconds_bucket" in text
    assert "rustinfer_generation_tokens_total" in text
