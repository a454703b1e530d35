"""Penalties, min_tokens, logprobs / top_logprobs and echo through the real server and the fake scheduler:
what the Submit carries and the OpenAI response schemas (chat and completions, streaming and not)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from infer_server.tokenizer import Tokenizer
from tests.server.conftest import ANSWER, ServerHarness
from tests.server.fake_scheduler import fake_logprob, fake_prompt_logprob
from tests.server.sse_util import chat_text, completion_text, parse_sse

USER = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def _stream(server: ServerHarness, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with server.http.stream("POST", path, json=body | {"stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = parse_sse(resp.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def _answer_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(ANSWER, add_special_tokens=False)


def test_submit_carries_the_sampling_fields(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "submit fields"}], "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repetition_penalty": 1.2, "min_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "max_tokens": 20})
    assert r.status_code == 200, r.text
    sub = server.fake.submits[-1]
    s = sub.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (s.min_tokens, sub.min_tokens, s.logprobs, s.top_logprobs) == (3, 3, True, 2)
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    s = server.fake.submits[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.logprobs,
            s.top_logprobs) == (0.0, 0.0, 1.0, 0, False, 0)
    server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 0})
    s = server.fake.submits[-1].sampling
    assert (s.logprobs, s.top_logprobs) == (True, 0)


def test_submit_carries_logit_bias_as_sorted_pairs(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "bias"}], "max_tokens": 5,
        "logit_bias": {"17": -100, "3": 2.5, "250": 100}})
    assert r.status_code == 200, r.text
    assert server.fake.submits[-1].sampling.logit_bias == ((3, 2.5), (17, -100.0), (250, 100.0))
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2, "logit_bias": {"9": 1}})
    assert r.status_code == 200, r.text
    assert [sub.sampling.logit_bias for sub in server.fake.submits[-2:]] == [((9, 1.0),)] * 2  # every choice
    server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logit_bias": {}})
    assert server.fake.submits[-1].sampling.logit_bias == ()


def test_submit_carries_allowed_token_ids_sorted_and_unique(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "allowed_token_ids": [9, 2, 9, 40]})
    assert r.status_code == 200, r.text
    assert server.fake.submits[-1].sampling.allowed_token_ids == (2, 9, 40)
    server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert server.fake.submits[-1].sampling.allowed_token_ids == ()


def _check_chat_entries(content: list[dict[str, Any]], tok: Tokenizer, k: int) -> None:
    ids = _answer_ids(tok)
    assert len(content) == len(ids)  # every visible token; the EOS that ended the answer has none
    for i, (entry, tid) in enumerate(zip(content, ids)):
        raw = tok.token_bytes(tid)
        assert entry["bytes"] == list(raw)
        assert entry["token"] == raw.decode("utf-8", errors="backslashreplace")
        assert entry["logprob"] == fake_logprob(i)
        tops = entry["top_logprobs"]
        assert len(tops) == k and set(tops[0]) == {"token", "logprob", "bytes"} if k else tops == []
        if k:
            assert tops[0]["token"] == entry["token"] and tops[0]["logprob"] == entry["logprob"]
            assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == ANSWER


@pytest.mark.parametrize("k", [0, 3])
def test_chat_logprobs_non_streaming(server: ServerHarness, tokenizer: Tokenizer, k: int) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": k})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == ANSWER and choice["finish_reason"] == "stop"
    assert set(choice["logprobs"]) == {"content"}
    _check_chat_entries(choice["logprobs"]["content"], tokenizer, k)


def test_chat_logprobs_streaming(server: ServerHarness, tokenizer: Tokenizer) -> None:
    chunks = _stream(server, "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2})
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    content: list[dict[str, Any]] = []
    for chunk in chunks[1:]:
        choice = chunk["choices"][0]
        text = choice["delta"].get("content")
        if text:
            entries = choice["logprobs"]["content"]
            # each chunk carries exactly the tokens that spell its text (held-back bytes travel with it)
            assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
            content += entries
        elif choice["logprobs"] is not None:
            content += choice["logprobs"]["content"]
    assert chat_text(chunks) == ANSWER
    _check_chat_entries(content, tokenizer, 2)


def test_chat_without_logprobs_has_none(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": USER, "logprobs": False, "top_logprobs": 0})
    assert r.json()["choices"][0]["logprobs"] is None


def _check_completion_logprobs(lp: dict[str, Any], tok: Tokenizer, text: str, k: int) -> None:
    ids = _answer_ids(tok)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
    raw = b""
    for i, tid in enumerate(ids):
        token = tok.token_bytes(tid).decode("utf-8", errors="backslashreplace")
        assert lp["tokens"][i] == token and lp["token_logprobs"][i] == fake_logprob(i)
        top = lp["top_logprobs"][i]
        assert top[token] == fake_logprob(i) and len(top) <= k + 1 and len(top) >= max(k, 1)
        # the character offset of the token in the completion text
        assert lp["text_offset"][i] == len(raw.decode("utf-8", errors="ignore"))
        raw += tok.token_bytes(tid)
    assert raw.decode() == text


@pytest.mark.parametrize("k", [0, 2])
def test_completion_logprobs_non_streaming(server: ServerHarness, tokenizer: Tokenizer, k: int) -> None:
    r = server.http.post("/v1/completions", json={"prompt": PROMPT, "logprobs": k, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["text"] == ANSWER
        _check_completion_logprobs(choice["logprobs"], tokenizer, ANSWER, k)


def test_completion_logprobs_streaming(server: ServerHarness, tokenizer: Tokenizer) -> None:
    chunks = _stream(server, "/v1/completions", {"prompt": PROMPT, "logprobs": 2})
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        lp = chunk["choices"][0]["logprobs"]
        if lp is not None:
            for key in merged:
                merged[key] += lp[key]
    assert completion_text(chunks) == ANSWER
    _check_completion_logprobs(merged, tokenizer, ANSWER, 2)  # the offsets run on across chunks


def test_echo(server: ServerHarness, tokenizer: Tokenizer) -> None:
    r = server.http.post("/v1/completions", json={"prompt": PROMPT, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == PROMPT + ANSWER
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    r = server.http.post("/v1/completions", json={"prompt": ids, "echo": True, "n": 2})
    assert [c["text"] for c in r.json()["choices"]] == [tokenizer.decode(ids) + ANSWER] * 2
    chunks = _stream(server, "/v1/completions", {"prompt": PROMPT, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert completion_text(chunks) == PROMPT + ANSWER
    r = server.http.post("/v1/completions", json={"prompt": PROMPT, "echo": False})
    assert r.json()["choices"][0]["text"] == ANSWER


def test_echo_with_logprobs_puts_the_prompt_tokens_first(server: ServerHarness, tokenizer: Tokenizer) -> None:
    """OpenAI's legacy scoring form (lm-eval's loglikelihood): the prompt tokens' logprobs precede the generated
    ones, the first prompt token with null; text offsets run over the echoed prompt, then the completion."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    r = server.http.post("/v1/completions", json={"prompt": [prompt_ids, prompt_ids[:2]], "echo": True,
                                                  "logprobs": 2, "max_tokens": 1})
    assert r.status_code == 200, r.text
    subs = server.fake.submits[-2:]
    assert all(s.sampling.prompt_logprobs and s.sampling.logprobs and s.sampling.top_logprobs == 2 for s in subs)
    first, short = r.json()["choices"]
    lp = first["logprobs"]
    texts = [tokenizer.token_bytes(t).decode() for t in prompt_ids]
    answer_first = tokenizer.encode(ANSWER, add_special_tokens=False)[0]
    assert lp["tokens"] == texts + [tokenizer.token_bytes(answer_first).decode()]
    assert lp["token_logprobs"] == [None] + [fake_prompt_logprob(p) for p in range(1, len(prompt_ids))] + [
        fake_logprob(0)]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    assert lp["top_logprobs"][1][texts[1]] == fake_prompt_logprob(1)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts) + 1)]
    assert lp["text_offset"] == offsets and first["text"].startswith(tokenizer.decode(prompt_ids))
    assert short["logprobs"]["token_logprobs"][:2] == [None, fake_prompt_logprob(1)]
    one = server.http.post("/v1/completions", json={"prompt": prompt_ids[:1], "echo": True, "logprobs": 0,
                                                    "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert one["token_logprobs"] == [None, fake_logprob(0)] and one["text_offset"] == [0, len(texts[0])]
    # streamed: the echo chunk waits for the prompt's logprobs; merged, the chunks equal the whole response
    chunks = _stream(server, "/v1/completions", {"prompt": [prompt_ids, prompt_ids[:2]], "echo": True, "logprobs": 2,
                                                 "max_tokens": 1})
    for index, choice in enumerate((first, short)):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["text"] == tokenizer.decode(choice_prompt := [prompt_ids, prompt_ids[:2]][index])
        assert len(mine[0]["logprobs"]["tokens"]) == len(choice_prompt)
        merged = {k: [v for c in mine if c["logprobs"] for v in c["logprobs"][k]] for k in choice["logprobs"]}
        assert merged == choice["logprobs"] and "".join(c["text"] for c in mine) == choice["text"]
    # max_tokens 0 scores the prompt only: the one token generated for it is not shown nor counted
    scored = server.http.post("/v1/completions", json={"prompt": [prompt_ids, prompt_ids[:2]], "echo": True,
                                                       "logprobs": 2, "max_tokens": 0}).json()
    for got, full in zip(scored["choices"], (first, short)):
        n_prompt = len(full["logprobs"]["tokens"]) - 1
        assert got["logprobs"] == {k: v[:n_prompt] for k, v in full["logprobs"].items()}
        assert got["finish_reason"] == "length" and got["text"] == tokenizer.decode(
            [prompt_ids, prompt_ids[:2]][got["index"]])
    assert scored["usage"]["completion_tokens"] == 0
    chunks = _stream(server, "/v1/completions", {"prompt": prompt_ids, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert [c["choices"][0]["text"] for c in chunks] == [tokenizer.decode(prompt_ids), ""]
    assert chunks[0]["choices"][0]["logprobs"] == scored["choices"][0]["logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    refused = server.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    # without echo, the prompt's logprobs are neither asked for nor shown
    r = server.http.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 1, "max_tokens": 1})
    assert not server.fake.submits[-1].sampling.prompt_logprobs and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 1


@pytest.mark.parametrize(("path", "body", "code", "param"), [
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 1}, "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1}, "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -2.01}, "invalid_value", "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "invalid_value", "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, "invalid_value", "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "invalid_value", "logprobs"),
])
def test_refusals_name_the_field(server: ServerHarness, path: str, body: dict[str, Any], code: str, param: str) -> None:
    r: httpx.Response = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param)


def test_penalty_bounds_are_accepted(server: ServerHarness) -> None:
    for body in ({"presence_penalty": -2, "frequency_penalty": 2}, {"repetition_penalty": 0.01},
                 {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 2.5}):
        r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2} | body)
        assert r.status_code == 200, (body, r.text)
