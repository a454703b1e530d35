"""Readiness, disconnects, overload, timeouts, a silent or worker-less scheduler, body limits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer_protocol.messages import SchedulerStats
from infer_server.tokenizer import Tokenizer
from tests.server.conftest import ServerHarness
from tests.server.sse_util import parse_sse
from tests.server.tiny_model import write_model_dir

MakeServer = Callable[..., ServerHarness]
USER = [{"role": "user", "content": "hello"}]


def _err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_ready_503_until_the_first_ready_pong(make_server: MakeServer) -> None:
    s = make_server(start_scheduler=False)
    assert s.http.get("/health").status_code == 200
    r = s.http.get("/ready")
    assert r.status_code == 503 and "waiting for the scheduler" in r.json()["detail"]
    assert r.headers["retry-after"] == "5"
    r = s.http.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 503 and _err(r)["code"] == "model_not_ready" and r.headers["retry-after"] == "5"
    assert _err(s.http.post("/tokenize", json={"prompt": "x"}))["code"] == "model_not_ready"
    assert s.http.get("/v1/models").status_code == 503  # the model's name is not known yet
    s.fake.ready = False
    s.start_scheduler()
    deadline = time.monotonic() + 5
    while "loading weights" not in s.http.get("/ready").text:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert s.http.get("/ready").status_code == 503
    s.fake.ready = True
    s.wait_ready(5)
    assert s.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).status_code == 200


def _wait_abort(s: ServerHarness, request_id: str) -> None:
    assert s.fake.wait_for(lambda: request_id in s.fake.aborts, timeout=5), (request_id, s.fake.aborts)


@pytest.mark.parametrize("prompt", ["LONG", "HANG"])  # mid-stream, and while waiting for the first token
def test_client_disconnect_aborts_stream(make_server: MakeServer, prompt: str) -> None:
    s = make_server(step_interval=0.02)
    s.wait_ready()

    async def main() -> str:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            body = {"messages": [{"role": "user", "content": prompt}], "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = resp.aiter_lines()
                first = await lines.__anext__()
                rid = json.loads(first[len("data: "):])["id"]
                if prompt == "LONG":
                    got = 0
                    async for line in lines:
                        got += line.startswith("data: ")
                        if got >= 3:
                            break
            return str(rid)  # leaving the block closes the connection mid-stream

    rid = asyncio.run(main())
    _wait_abort(s, rid)
    assert s.fake.wait_for(lambda: s.fake.num_running == 0)
    assert s.fake.wait_for(lambda: s.app.state.server.inflight == 0)  # the admission slot is given back


def test_client_disconnect_aborts_non_streaming(make_server: MakeServer) -> None:
    s = make_server()
    s.wait_ready()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json={"prompt": "HANG"}, timeout=0.5)
    assert s.fake.wait_for(lambda: len(s.fake.aborts) == 1)
    assert s.fake.aborts[0] == s.fake.submits[0].request_id


def test_overload_answers_429(make_server: MakeServer) -> None:
    s = make_server(max_inflight_requests=2)
    s.wait_ready()

    async def main() -> None:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            body = {"prompt": "HANG", "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as a, \
                    client.stream("POST", "/v1/completions", json=body) as b:
                assert a.status_code == b.status_code == 200
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert _err(r)["code"] == "rate_limit_exceeded" and _err(r)["type"] == "rate_limit_error"
        # both streams closed: capacity is back
        deadline = time.monotonic() + 5
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            while True:
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            assert r.status_code == 200

    asyncio.run(main())


def test_request_timeout(make_server: MakeServer) -> None:
    s = make_server(request_timeout_secs=0.3)
    s.wait_ready()
    r = s.http.post("/v1/completions", json={"prompt": "HANG"})
    assert r.status_code == 504 and _err(r)["code"] == "timeout"
    _wait_abort(s, s.fake.submits[-1].request_id)
    with s.http.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "HANG"}], "stream": True}) as resp:
        events = parse_sse(resp.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["code"] == "timeout"
    assert events[-1] == "[DONE]"
    _wait_abort(s, events[0]["id"])


def test_silent_scheduler_fails_inflight_requests(make_server: MakeServer) -> None:
    s = make_server(scheduler_timeout_secs=0.5)
    s.wait_ready()
    with s.http.stream("POST", "/v1/completions", json={"prompt": "HANG", "stream": True}) as resp:
        s.fake.silent = True
        start = time.monotonic()
        events = parse_sse(resp.iter_lines())
    assert time.monotonic() - start < 3
    assert events[-2]["error"]["code"] == "scheduler_lost"
    assert events[-1] == "[DONE]"
    assert s.http.get("/ready").status_code == 503
    r = s.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and _err(r)["code"] == "model_not_ready"
    s.fake.silent = False
    s.wait_ready(5)


def test_lost_worker_fails_inflight_requests(make_server: MakeServer) -> None:
    s = make_server()
    s.wait_ready()

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "HANG"}))
            while not s.fake.submits:
                await asyncio.sleep(0.01)
            s.fake.stats = SchedulerStats()  # like the real one: a scheduler without a worker holds no requests
            s.fake.ready = False
            return await task

    r = asyncio.run(main())
    assert r.status_code == 503 and _err(r)["code"] == "worker_lost" and r.headers["retry-after"] == "5"
    assert s.http.get("/ready").status_code == 503


def test_draining_scheduler_finishes_inflight_requests(make_server: MakeServer) -> None:
    """A scheduler that stops being ready while it still runs requests (SIGTERM: it drains) is left to finish
    them; the server only refuses new ones."""
    s = make_server(step_interval=0.01)
    s.wait_ready()

    async def main() -> tuple[httpx.Response, int, httpx.Response]:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "SLOW", "max_tokens": 4}))
            while not s.fake.submits:
                await asyncio.sleep(0.01)
            s.fake.ready = False  # its stats still show running requests
            await asyncio.sleep(0.3)  # several pongs
            ready = (await client.get("/ready")).status_code
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            return await task, ready, refused

    r, ready, refused = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert ready == 503
    assert refused.status_code == 503 and _err(refused)["code"] == "model_not_ready"


def test_body_limit_413(make_server: MakeServer) -> None:
    s = make_server(max_request_body_bytes=2000)
    s.wait_ready()
    big = {"prompt": "x" * 5000}
    r = s.http.post("/v1/completions", json=big)
    assert r.status_code == 413 and _err(r)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no content-length: chunked transfer
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    r = httpx.post(f"{s.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and _err(r)["code"] == "request_too_large"
    assert s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "\\udfff", "prompt": "hi", "max_tokens": 2}', "model"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["ok", "\\ud83d"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83dx"}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"prompt": "x", "\\ud800": 1}', None),
    ("/tokenize", '{"messages": [{"\\ud800": {"x": "\\udc00"}}]}', "messages"),
])
def test_lone_surrogates_are_400(make_server: MakeServer, path: str, raw: str, param: str | None) -> None:
    """JSON may escape a lone UTF-16 surrogate; such a string is not Unicode (the tokenizer and the JSON
    encoder both fail on it), so it is refused, naming the field, instead of failing with a 500."""
    s = make_server()
    s.wait_ready()
    r = s.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert _err(r)["code"] == "invalid_value" and _err(r)["param"] == param
    # an escaped surrogate pair is an ordinary character
    ok = s.http.post("/tokenize", content='{"prompt": "\\ud83d\\ude42 \\\\ud800"}',
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_body_nested_too_deeply_is_invalid_json(make_server: MakeServer) -> None:
    s = make_server()
    s.wait_ready()
    r = s.http.post("/v1/completions", content="[" * 100_000 + "]" * 100_000,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and _err(r)["code"] == "invalid_json"


def test_top_k_beyond_the_vocabulary_is_off(make_server: MakeServer) -> None:
    """top_k >= vocab keeps every token: it is sent as 0 (off), never as a number the engine cannot hold."""
    s = make_server()
    s.wait_ready()
    r = s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "top_k": 10**11})
    assert r.status_code == 200, r.text
    assert [sub.sampling.top_k for sub in s.fake.submits] == [0]


def test_model_without_chat_template(make_server: MakeServer, tmp_path: Path, tokenizer: Tokenizer) -> None:
    s = make_server(start_scheduler=False)
    s.fake.model_dir = str(write_model_dir(tmp_path / "no-template", chat_template=None))
    s.start_scheduler()
    s.wait_ready()
    r = s.http.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400 and _err(r)["code"] == "chat_template_missing"
    assert s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_template_raise_exception_is_400(make_server: MakeServer, tmp_path: Path) -> None:
    src = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    s = make_server(start_scheduler=False, model_name="served-name")
    s.fake.model_dir = str(write_model_dir(tmp_path / "strict", chat_template=src))
    s.start_scheduler()
    s.wait_ready()
    r = s.http.post("/v1/chat/completions", json={"model": "served-name",
                                                  "messages": [{"role": "system", "content": "x"}]})
    assert r.status_code == 400
    err = _err(r)
    assert err["code"] == "chat_template_error" and "System role not supported" in err["message"]
    assert s.http.get("/v1/models").json()["data"][0]["id"] == "served-name"
    # the model directory's name is accepted too
    r = s.http.post("/v1/chat/completions", json={"model": "strict", "messages": USER, "max_tokens": 2})
    assert r.status_code == 200


def test_scheduler_gone_at_submit_is_503(make_server: MakeServer) -> None:
    s = make_server()
    s.wait_ready()
    s.fake.stop()
    s._scheduler_started = False
    time.sleep(0.1)
    r = s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503
    assert _err(r)["code"] in ("scheduler_unavailable", "model_not_ready", "scheduler_lost")
