"""The front door: strict request types, non-JSON literals and content types, body timeouts and disconnects,
405 / HEAD / no Host-built redirect, Retry-After, completions' default max_tokens, fresh /metrics, no admission slot
lost to a cancelled stream, and a long prompt that does not stall the event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer_protocol.messages import SchedulerStats
from tests.server.conftest import MAX_MODEL_LEN, ServerHarness

MakeServer = Callable[..., ServerHarness]
USER = [{"role": "user", "content": "hello"}]


def _err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


# ------------------------------------------------------------------ strict types


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 1.0}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": "3"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
])
def test_loose_types_are_400(server: ServerHarness, path: str, body: dict[str, Any], param: str) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = _err(r)
    assert (err["code"], err["param"]) == ("invalid_value", param), err
    assert f"'{param}" in err["message"]


def test_union_error_names_the_field_and_its_types(server: ServerHarness) -> None:
    err = _err(server.http.post("/v1/completions", json={"prompt": [True, False], "max_tokens": 2}))
    assert err["message"].startswith("Invalid value for 'prompt': matches none of its accepted types (str, list[str], "
                                     "list[int], list[list[int]])"), err


def test_floats_still_take_integers(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 1, "top_p": 1,
                                                  "presence_penalty": 0, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text
    assert server.fake.submits[-1].sampling.temperature == 1.0


@pytest.mark.parametrize(("raw", "literal", "where"), [
    ('{"prompt": "x", "max_tokens": 2, "temperature": NaN}', "NaN", "temperature"),
    ('{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', "Infinity", "top_p"),
    ('{"prompt": "x", "max_tokens": 2, "logit_bias": {"5": -Infinity}}', "-Infinity", "logit_bias.5"),
])
def test_nan_and_infinity_are_400(server: ServerHarness, raw: str, literal: str, where: str) -> None:
    r = server.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = _err(r)
    assert err["code"] == "invalid_json" and err["param"] == where.split(".")[0]
    assert literal in err["message"] and f"'{where}'" in err["message"]
    # the words inside strings are text
    ok = server.http.post("/tokenize", content='{"prompt": "NaN Infinity -Infinity"}',
                          headers={"content-type": "application/json"})
    assert ok.status_code == 200


def test_text_part_without_text_says_so(server: ServerHarness) -> None:
    r = server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    err = _err(r)
    assert r.status_code == 400 and err["code"] == "missing_required_parameter"
    assert "messages[0].content[0].text" in err["message"]


def test_non_json_content_type_is_415_naming_it(server: ServerHarness) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = server.http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert r.status_code == 415, r.text
        err = _err(r)
        assert err["code"] == "unsupported_media_type"
        assert content_type in err["message"] and "application/json" in err["message"]
    ok = server.http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    # no Content-Type at all: parsed as JSON (a browser cannot send a body without one)
    bare = server.http.post("/v1/completions", content=body.encode())
    assert "content-type" not in bare.request.headers and bare.status_code == 200, bare.text


# ------------------------------------------------------------------ routes, methods, redirects


POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_wrong_method_is_405_with_allow(server: ServerHarness, path: str, method: str) -> None:
    r = server.http.request(method, path)
    assert r.status_code == 405, (method, path, r.status_code, r.text)
    assert _err(r)["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]


def test_head_health(server: ServerHarness) -> None:
    r = server.http.head("/health")
    assert r.status_code == 200 and r.content == b""
    assert server.http.head("/ready").status_code == 200


def test_no_redirect_built_from_host(server: ServerHarness) -> None:
    for path in ("/v1/models/", "/health/", "/v1/completions/"):
        r = server.http.request("GET" if "models" in path or "health" in path else "POST", path,
                                headers={"host": "evil.example"}, json={} if "completions" in path else None)
        assert not 300 <= r.status_code < 400, (path, r.status_code, r.headers)
        assert "evil.example" not in r.headers.get("location", "")


# ------------------------------------------------------------------ Retry-After


def test_retry_after_on_503_and_429(make_server: MakeServer) -> None:
    s = make_server(start_scheduler=False, max_inflight_requests=1)
    r = s.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert s.http.get("/ready").headers["retry-after"] == "5"
    s.start_scheduler()
    s.wait_ready()

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as client:
            async with client.stream("POST", "/v1/completions", json={"prompt": "HANG", "stream": True}) as held:
                assert held.status_code == 200
                return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

    r = asyncio.run(main())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "retry-after" not in s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": "x"}).headers


# ------------------------------------------------------------------ defaults


def test_completions_default_to_16_tokens_chat_to_the_context(server: ServerHarness) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "LONG"})
    assert r.status_code == 200, r.text
    assert server.fake.submits[-1].max_tokens == 16 and r.json()["usage"]["completion_tokens"] == 16
    r = server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "LONG"}]})
    assert r.status_code == 200
    sub = server.fake.submits[-1]
    assert sub.max_tokens == MAX_MODEL_LEN - len(sub.prompt_token_ids)


def test_completions_default_is_cut_to_the_context(server: ServerHarness, tokenizer: Any) -> None:
    ids = [tokenizer.token_to_id("a")] * (MAX_MODEL_LEN - 5)
    r = server.http.post("/v1/completions", json={"prompt": ids})
    assert r.status_code == 200, r.text
    assert server.fake.submits[-1].max_tokens == 5


# ------------------------------------------------------------------ bodies: timeouts, disconnects


def _raw(s: ServerHarness, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.config.port), timeout=10)
    sock.sendall(data)
    return sock


def _metric(s: ServerHarness, name: str, **labels: str) -> float:
    total = 0.0
    for line in s.http.get("/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(f'{k}="{v}"' in line
                                                                                for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_partial_body_times_out_with_408(make_server: MakeServer) -> None:
    s = make_server(request_body_timeout_secs=0.3)
    s.wait_ready()
    sock = _raw(s, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 100\r\n\r\n{\"prompt\": ")
    start = time.monotonic()
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    sock.close()
    assert time.monotonic() - start < 5
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_disconnect_during_upload_is_not_a_500(make_server: MakeServer, caplog: pytest.LogCaptureFixture) -> None:
    s = make_server()
    s.wait_ready()
    for _ in range(3):
        sock = _raw(s, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: 1000\r\n\r\n{\"prompt\": \"abc")
        time.sleep(0.05)
        sock.close()
    deadline = time.monotonic() + 5
    while _metric(s, "rustinfer_http_requests_total", endpoint="/v1/completions", status="499") < 3:
        assert time.monotonic() < deadline, s.http.get("/metrics").text
        time.sleep(0.02)
    assert _metric(s, "rustinfer_http_requests_total", status="500") == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


# ------------------------------------------------------------------ /metrics is current


def test_metrics_scrape_asks_for_fresh_scheduler_stats(make_server: MakeServer) -> None:
    """The heartbeat is slow here (5 s): a scrape must not read the last heartbeat's counters."""
    s = make_server(heartbeat_interval_secs=5.0, scheduler_timeout_secs=30.0)
    s.wait_ready()
    pings = s.fake.pings
    s.fake.stats = SchedulerStats(num_total_blocks=100, num_free_blocks=100, prefix_cache_queries_tokens=4096,
                                  prefix_cache_hits_tokens=128)
    assert _metric(s, "rustinfer_prefix_cache_hits_tokens_total") == 128
    assert s.fake.pings > pings


def test_metrics_falls_back_to_the_last_pong(make_server: MakeServer) -> None:
    s = make_server(scheduler_timeout_secs=30.0)
    s.wait_ready()
    s.fake.silent = True
    start = time.monotonic()
    r = s.http.get("/metrics")
    assert r.status_code == 200 and time.monotonic() - start < 2
    assert _metric(s, "rustinfer_prefix_cache_hits_tokens_total") == 250  # the fake's default stats
    s.fake.silent = False


# ------------------------------------------------------------------ admission slots


def test_stream_cancelled_before_its_body_runs_releases_its_slot(make_server: MakeServer) -> None:
    """The ASGI task of a stream is cancelled while its response start is still being sent (so the body iterator
    never ran): the slot comes back and the request is aborted at the scheduler."""
    s = make_server(max_inflight_requests=64)
    s.wait_ready()
    state = s.app.state.server
    uvicorn_loop = s.app.state.server.client._tasks[0].get_loop()  # the loop uvicorn serves the app on

    async def one(i: int) -> None:
        body = json.dumps({"prompt": "HANG", "stream": True}).encode()
        sent_body = False
        blocked = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                blocked.set()
                await asyncio.Event().wait()  # a client that never reads: the start never leaves

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        task = asyncio.create_task(s.app(scope, receive, send))
        await blocked.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def many() -> None:
        await asyncio.gather(*(one(i) for i in range(20)))

    asyncio.run_coroutine_threadsafe(many(), uvicorn_loop).result(20)
    assert s.fake.wait_for(lambda: len(s.fake.submits) == 20)
    assert s.fake.wait_for(lambda: state.inflight == 0), state.inflight
    assert s.fake.wait_for(lambda: s.fake.num_running == 0)
    assert sorted(s.fake.aborts) == sorted(sub.request_id for sub in s.fake.submits)
    assert _metric(s, "rustinfer_num_requests_inflight") == 0


def test_many_streams_closed_right_after_sending_leave_nothing(make_server: MakeServer) -> None:
    s = make_server(max_inflight_requests=64)
    s.wait_ready()
    body = json.dumps({"prompt": "HANG", "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    socks = [_raw(s, request) for _ in range(40)]
    for sock in socks:
        sock.close()
    state = s.app.state.server
    deadline = time.monotonic() + 10
    while _metric(s, "rustinfer_http_requests_total", endpoint="/v1/completions") < 40:  # every one was answered
        assert time.monotonic() < deadline, s.http.get("/metrics").text
        time.sleep(0.02)
    assert s.fake.wait_for(lambda: state.inflight == 0 and s.fake.num_running == 0), (state.inflight,
                                                                                      s.fake.num_running)
    assert set(s.fake.aborts) == {sub.request_id for sub in s.fake.submits}
    assert _metric(s, "rustinfer_num_requests_inflight") == 0


# ------------------------------------------------------------------ a long prompt does not stall the loop


WORDS = 1_300_000


@pytest.fixture
def smol_server(make_server: MakeServer, embedded_model_dir: Path) -> Callable[..., ServerHarness]:
    def make(max_model_len: int) -> ServerHarness:
        s = make_server(start_scheduler=False, max_request_body_bytes=16 * 1024 * 1024)
        s.fake.model_dir = str(embedded_model_dir)
        s.fake.max_model_len = max_model_len
        s.fake.vocab_size = 49152
        s.start_scheduler()
        s.wait_ready()
        return s
    return make


def _health_latencies(s: ServerHarness, while_running: threading.Event | None, count: int = 20) -> list[float]:
    out = []
    with httpx.Client(base_url=s.url, timeout=30) as client:
        while (while_running is not None and not while_running.is_set()) or (while_running is None
                                                                                and len(out) < count):
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            out.append(time.perf_counter() - start)
    return out


def test_long_prompt_does_not_stall_health(smol_server: Callable[..., ServerHarness]) -> None:
    """1.3 million words tokenized (1-2 s of CPU) and then refused as too long: /health keeps answering within tens of
    milliseconds meanwhile (on the event loop it waited for the whole tokenization)."""
    s = smol_server(40_000)  # long enough that the prompt has to be tokenized to be refused
    baseline = _health_latencies(s, None)
    done = threading.Event()
    result: list[httpx.Response] = []
    prompt = "a " * WORDS

    def big() -> None:
        try:
            result.append(httpx.post(f"{s.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60))
        finally:
            done.set()

    thread = threading.Thread(target=big)
    start = time.perf_counter()
    thread.start()
    during = _health_latencies(s, done)
    elapsed = time.perf_counter() - start
    thread.join()
    r = result[0]
    assert r.status_code == 400 and _err(r)["code"] == "context_length_exceeded", r.text
    assert f"{WORDS + 1} in the prompt" in _err(r)["message"]  # counted exactly: it was tokenized
    worst, base = max(during), sorted(baseline)[len(baseline) // 2]
    print("slowest", [round(x * 1e3) for x in sorted(during)[-8:]])
    print(f"huge request {elapsed:.2f} s; /health during it: {len(during)} checks, worst {worst * 1e3:.0f} ms, "
          f"baseline median {base * 1e3:.1f} ms")
    assert len(during) >= 5, (elapsed, during)
    assert worst < 0.15, (worst, base, elapsed)


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(smol_server: Callable[..., ServerHarness]) -> None:
    s = smol_server(2048)
    start = time.perf_counter()
    r = s.http.post("/v1/completions", json={"prompt": "a " * WORDS, "max_tokens": 1}, timeout=60)
    elapsed = time.perf_counter() - start
    err = _err(r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "is at least" in err["message"] and f"{2 * WORDS} characters" in err["message"], err
    r = s.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * WORDS}]}, timeout=60)
    assert r.status_code == 400 and "is at least" in _err(r)["message"]
    print(f"refused in {elapsed * 1e3:.0f} ms")
    # a prompt the bound cannot rule out is tokenized and counted exactly
    r = s.http.post("/v1/completions", json={"prompt": "a " * 3000, "max_tokens": 1})
    assert r.status_code == 400 and "3001 in the prompt" in _err(r)["message"]


def test_prompts_past_a_few_thousand_characters_are_tokenized_off_the_event_loop() -> None:
    """`off_loop` keeps a short text inline (a thread hop would cost more) and moves a longer one, which would hold
    back every stream of the process for milliseconds, to a worker thread."""
    import asyncio
    import threading

    from infer_server.prompts import OFF_LOOP_CHARS, off_loop

    async def where(size: int) -> threading.Thread:
        return await off_loop(size, threading.current_thread)

    async def both() -> tuple[threading.Thread, threading.Thread, threading.Thread]:
        return threading.current_thread(), await where(OFF_LOOP_CHARS - 1), await where(6_000)

    loop_thread, short, long_ = asyncio.run(both())
    assert short is loop_thread and long_ is not loop_thread
    assert OFF_LOOP_CHARS <= 4_096  # a ~3,000-token prompt (~6,000 characters) leaves the loop
