"""`api_key`: the API (/v1/*, /tokenize, /detokenize) needs `Authorization: Bearer <key>`; probes stay open."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import pytest

from infer_protocol.config import load_config
from infer_server import middleware
from infer_server.app import create_app
from tests.server.conftest import ServerHarness

MakeServer = Callable[..., ServerHarness]
CALLS = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
]


def _call(s: ServerHarness, method: str, path: str, body: Any, key: str | None = None, **headers: str) -> Any:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return s.http.request(method, path, json=body, headers=headers)


def test_keys_guard_the_api(make_server: MakeServer) -> None:
    s = make_server(api_key="key-one, key-two")  # a comma-separated string, as RUSTINFER_API_KEY gives it
    s.wait_ready()
    for method, path, body in CALLS:
        r = _call(s, method, path, body)
        assert r.status_code == 401, (path, r.text)
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
        assert "didn't provide an API key" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
        wrong = _call(s, method, path, body, key="key-three")
        assert wrong.status_code == 401 and "Incorrect API key" in wrong.json()["error"]["message"]
        basic = _call(s, method, path, body, authorization="Basic a2V5LW9uZQ==")
        assert basic.status_code == 401 and "Bearer" in basic.json()["error"]["message"]
        for key in ("key-one", "key-two"):
            assert _call(s, method, path, body, key=key).status_code == 200, (path, key)
    assert _call(s, "POST", "/v1/completions", CALLS[1][2], authorization="bearer key-two").status_code == 200
    for path in ("/health", "/ready", "/metrics", "/metrics/system", "/openapi.json"):
        assert s.http.get(path).status_code == 200, path  # probes, scrapes and the schema stay open
    metrics = s.http.get("/metrics").text
    assert 'endpoint="/v1/completions",method="POST",status="401"' in metrics


def test_keys_as_a_list_and_protected_metrics(make_server: MakeServer) -> None:
    s = make_server(api_key=["k1"], api_key_protects_metrics=True)
    s.wait_ready()
    assert s.http.get("/metrics").status_code == 401
    assert s.http.get("/metrics/system").status_code == 401
    assert s.http.get("/metrics", headers={"authorization": "Bearer k1"}).status_code == 200
    assert s.http.get("/health").status_code == 200 and s.http.get("/ready").status_code == 200


def test_no_key_configured_means_open(server: ServerHarness) -> None:
    for method, path, body in CALLS:
        assert _call(server, method, path, body).status_code == 200, path


def test_keys_are_compared_in_constant_time(make_server: MakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    s = make_server(api_key="alpha,beta")
    s.wait_ready()
    assert _call(s, "GET", "/v1/models", None, key="alpha").status_code == 200
    assert seen == [(b"alpha", b"alpha"), (b"alpha", b"beta")]  # every key, even after a match


def test_open_non_loopback_host_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="infer_server.app"):
        create_app(load_config(overrides={"host": "0.0.0.0"}, environ={}))
    assert any("without an api_key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer_server.app"):
        create_app(load_config(overrides={"host": "0.0.0.0", "api_key": "k"}, environ={}))
        create_app(load_config(overrides={"host": "::1"}, environ={}))
        create_app(load_config(overrides={"host": "localhost"}, environ={}))
    assert not [r for r in caplog.records if "without an api_key" in r.getMessage()]


def test_env_var_gives_the_keys() -> None:
    config = load_config(environ={"RUSTINFER_API_KEY": "a,b"})
    assert config.api_keys == ("a", "b")
    assert load_config(environ={"RUSTINFER_API_KEY": '["x"]'}).api_keys == ("x",)
    assert load_config(environ={}).api_keys == ()
