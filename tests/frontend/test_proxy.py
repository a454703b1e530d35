"""The console's Python side: `static_dir()`, the entry point the server discovers, and the reverse proxy
(real uvicorn, real sockets) in front of a stand-in upstream that streams SSE and serves /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from importlib.metadata import entry_points

import httpx
import pytest

from infer_frontend import static_dir
from infer_frontend.cli import parse_args
from infer_frontend.proxy import create_app
from tests.frontend.conftest import FrontendProcess, StandIn
from tests.frontend.standin import MODEL, ServerThread


@pytest.fixture(scope="module")
def proxy(standin: StandIn) -> Iterator[str]:
    with ServerThread(create_app(standin.url)) as server:
        yield server.url


def test_static_dir_holds_the_page() -> None:
    d = static_dir()
    assert d.is_dir()
    assert {"index.html", "app.css", "app.js"} <= {p.name for p in d.iterdir()}
    html = (d / "index.html").read_text()
    assert '<meta name="rustinfer-api" content="">' in html
    assert 'src="app.js"' in html and 'href="app.css"' in html  # relative: works under any mount point


def test_entry_point_lets_the_server_find_the_page_without_importing_it() -> None:
    (ep,) = [e for e in entry_points(group="rustinfer.static") if e.name == "console"]
    assert ep.value == "infer_frontend:static_dir"
    assert ep.load()() == static_dir()


def test_serves_the_static_files(proxy: str) -> None:
    index = httpx.get(proxy + "/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "RustInfer console" in index.text
    js = httpx.get(proxy + "/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    css = httpx.get(proxy + "/app.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert httpx.get(proxy + "/nope.txt").status_code == 404


def test_proxies_models_ready_health_and_metrics(proxy: str, standin: StandIn) -> None:
    assert httpx.get(proxy + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(proxy + "/health").text == "ok"
    assert httpx.get(proxy + "/ready").status_code == 200
    standin.state.ready = False
    try:
        assert httpx.get(proxy + "/ready").status_code == 503
    finally:
        standin.state.ready = True
    m = httpx.get(proxy + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert "rustinfer_num_requests_running" in m.text
    assert httpx.get(proxy + "/metrics/system").json()["backend"] == "stand-in-cpu"


def test_forwards_method_query_headers_and_body(proxy: str) -> None:
    r = httpx.post(proxy + "/v1/echo?a=1&b=two", content=b'{"x": 1}',
                   headers={"content-type": "application/json", "authorization": "Bearer k", "x-request-id": "r-7"})
    assert r.status_code == 200
    seen = r.json()
    assert seen["method"] == "POST" and seen["path"] == "/v1/echo" and seen["query"] == "a=1&b=two"
    assert seen["body"] == '{"x": 1}'
    assert seen["headers"]["authorization"] == "Bearer k" and seen["headers"]["x-request-id"] == "r-7"
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert seen["headers"]["host"] != httpx.URL(proxy).netloc.decode()  # the upstream's own host, not ours
    assert r.headers["x-request-id"] == "echo-1" and r.headers["set-cookie"] == "a=b"


def test_passes_api_errors_through_unchanged(proxy: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "please fail"}], "stream": True}
    r = httpx.post(proxy + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(proxy + "/v1/chat/completions", json=body | {"model": "other"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def test_streams_sse_chunks_as_they_arrive(proxy: str, standin: StandIn) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", proxy + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("chatcmpl-")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - t0, line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    chunks = [json.loads(p) for _, p in arrivals[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The capital of France is Paris."
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    # Unbuffered: the first token arrived well before the last one (the stand-in spaces them 60 ms apart).
    first_token = next(t for t, p in arrivals if '"content": "The"' in p)
    assert arrivals[-1][0] - first_token > 0.25


def test_client_disconnect_reaches_the_upstream(proxy: str, standin: StandIn) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "stream": True}
    before = len(standin.state.disconnects)
    got = 0
    with httpx.Client(timeout=30) as client, client.stream("POST", proxy + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got == 4:
                break  # leaving the block closes the connection mid-stream
    rid = standin.state.chat_headers and f"chatcmpl-{len(standin.state.chat_bodies) - 1}"
    assert standin.state.wait_for(lambda: len(standin.state.disconnects) > before, timeout=5), "upstream never saw the disconnect"
    assert standin.state.disconnects[-1] == rid
    assert rid not in standin.state.completed
    # The long answer has 4000 tokens; the upstream stopped after a handful.
    assert standin.state.streamed_tokens[rid] < 50


def test_unreachable_upstream_is_a_502_in_the_openai_error_shape() -> None:
    with ServerThread(create_app("http://127.0.0.1:9")) as server:
        r = httpx.get(server.url + "/v1/models")
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["type"] == "bad_gateway" and err["code"] == 502 and "127.0.0.1:9" in err["message"]
        assert httpx.get(server.url + "/").status_code == 200  # the page itself still loads


def test_cli_arguments() -> None:
    args = parse_args(["--server", "http://h:8000/", "--port", "9001", "--host", "0.0.0.0"])
    assert (args.server, args.port, args.host) == ("http://h:8000/", 9001, "0.0.0.0")
    assert parse_args(["--server", "http://h"]).port == 8080
    with pytest.raises(SystemExit):
        parse_args(["--server", "h:8000"])
    with pytest.raises(SystemExit):
        parse_args([])


def test_console_script_serves_page_and_proxies(frontend: FrontendProcess) -> None:
    assert "rustinfer-api" in httpx.get(frontend.url + "/").text
    assert httpx.get(frontend.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert "rustinfer_kv_cache_usage_ratio" in httpx.get(frontend.url + "/metrics").text
