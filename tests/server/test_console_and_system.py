from __future__ import annotations

from tests.server.conftest import ServerHarness


def test_console_is_served_at_root_without_shadowing_the_api(server: ServerHarness) -> None:
    page = server.http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "app.js" in page.text
    assert server.http.get("/app.js").status_code == 200
    missing = server.http.get("/nope.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert server.http.get("/v1/chat/completions").status_code == 405


def test_metrics_system_summarises_the_engine(server: ServerHarness) -> None:
    body = server.http.get("/metrics/system").json()
    assert body["ready"] is True and body["uptime_s"] >= 0
    assert body["backend"] and body["device"] and body["max_model_len"] > 0
