"""The console in headless Chromium, against the real `rustinfer-frontend` CLI proxying to a stand-in
upstream: streamed chat, stop, API errors, keyboard, the live panel, and the layout at desktop and phone
widths. Screenshots go to artifacts/frontend/."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infer_frontend import static_dir
from infer_frontend.proxy import create_app
from tests.frontend.browser import browser, needs_chromium, open_page  # noqa: F401
from tests.frontend.conftest import ARTIFACTS, FrontendProcess, StandIn
from tests.frontend.standin import MODEL, ServerThread

pytestmark = needs_chromium

FRANCE = "What is the capital of France?"


@pytest.fixture()
def page(browser: Any, frontend: FrontendProcess) -> Iterator[Any]:
    p = open_page(browser, frontend.url + "/")
    p.wait_for_function(f"document.getElementById('model').value === {MODEL!r}")
    yield p
    assert p.js_errors == [], p.js_errors
    p.context.close()


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


def last_assistant(page: Any) -> Any:
    return page.locator(".msg-assistant").last


def test_chat_streams_the_answer(page: Any, standin: StandIn) -> None:
    page.fill("#max-tokens", "64")
    page.eval_on_selector("#temperature", "e => { e.value = '0.3'; e.dispatchEvent(new Event('input')); }")
    # Record what the page shows at every DOM change, to see the answer arrive piece by piece.
    page.evaluate("""() => {
      window.__seen = [];
      new MutationObserver(() => {
        const b = [...document.querySelectorAll('.msg-assistant .bubble')].pop();
        window.__seen.push({text: b ? b.textContent : '', stop: !document.getElementById('stop').hidden,
                            send: !document.getElementById('send').hidden});
      }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#prompt", FRANCE)
    page.keyboard.press("Enter")
    reply = last_assistant(page)
    page.wait_for_function("document.querySelector('.msg-assistant')?.dataset.finish !== undefined")
    assert reply.locator(".bubble").inner_text() == "The capital of France is Paris."
    meta = reply.locator(".meta").inner_text()
    assert "finish: stop" in meta and "7 tokens" in meta and "TTFT" in meta
    assert page.is_visible("#send") and not page.is_visible("#stop")
    seen = page.evaluate("window.__seen")
    partial = [s for s in seen if "capital" in s["text"] and "Paris" not in s["text"]]
    assert partial, "the answer did not stream in piece by piece"
    assert all(s["stop"] and not s["send"] for s in partial), "Stop replaces Send while streaming"
    assert len({s["text"] for s in seen}) >= 7
    body = standin.state.chat_bodies[-1]
    assert body["model"] == MODEL and body["stream"] is True
    assert body["max_tokens"] == 64 and body["temperature"] == 0.3
    assert body["messages"] == [{"role": "user", "content": FRANCE}]
    shot(page, "chat-desktop-1280x800.png")

    # Multi-turn: the second request carries the whole conversation.
    page.fill("#prompt", "And Germany?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg-assistant .meta')[1]?.textContent.includes('finish: stop')")
    assert "(turn 2)" in last_assistant(page).locator(".bubble").inner_text()
    assert standin.state.chat_bodies[-1]["messages"] == [
        {"role": "user", "content": FRANCE},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And Germany?"},
    ]
    # New chat forgets the conversation.
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.is_visible("#empty-hint")


def test_tool_calls_are_sent_and_shown(page: Any, standin: StandIn) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    page.click("summary:has-text('Tools')")
    page.fill("#tools", json.dumps(tools))
    page.fill("#prompt", "What is the weather in Paris?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg-assistant')?.dataset.finish !== undefined")
    reply = last_assistant(page)
    assert reply.locator(".tool-call").inner_text() == 'get_weather({"city": "Paris"})'
    assert "finish: tool_calls" in reply.locator(".meta").inner_text()
    assert standin.state.chat_bodies[-1]["tools"] == tools
    # The call stays in the conversation: the next request carries it as the assistant's turn.
    page.fill("#prompt", "thanks")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg-assistant .meta')[1]?.textContent.includes('finish')")
    assert standin.state.chat_bodies[-1]["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    page.fill("#tools", "[not json")
    page.fill("#prompt", "again")
    page.keyboard.press("Enter")
    assert "Tools: not valid JSON" in page.locator(".api-error").last.inner_text()


def test_stop_ends_generation_and_the_server_sees_the_disconnect(page: Any, standin: StandIn) -> None:
    before = len(standin.state.disconnects)
    page.fill("#prompt", "Tell me a long story")
    page.keyboard.press("Enter")
    page.wait_for_function("(document.querySelector('.msg-assistant .bubble')?.textContent || '').split('word').length > 5")
    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg-assistant').dataset.finish === 'stopped'")
    reply = last_assistant(page)
    assert "stopped" in reply.locator(".meta").inner_text()
    assert page.is_visible("#send") and not page.is_visible("#stop")
    assert standin.state.wait_for(lambda: len(standin.state.disconnects) > before, timeout=5), "the upstream kept generating"
    text = reply.locator(".bubble").inner_text()
    page.wait_for_timeout(400)
    assert reply.locator(".bubble").inner_text() == text, "tokens kept arriving after stop"
    shot(page, "chat-stopped-1280x800.png")
    # The stopped partial answer stays in the conversation.
    page.fill("#prompt", "thanks")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg-assistant .meta')[1]?.textContent.includes('finish')")
    msgs = standin.state.chat_bodies[-1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"] == text


def test_api_errors_are_shown_clearly(page: Any) -> None:
    page.fill("#prompt", "please fail")
    page.keyboard.press("Enter")
    err = page.locator(".api-error").last
    err.wait_for()
    text = err.inner_text()
    assert "HTTP 400" in text and "invalid_request_error" in text and "max_tokens is too large" in text
    assert page.locator(".msg-user").last.get_attribute("class").count("not-sent") == 1
    assert page.input_value("#prompt") == "please fail"  # put back for a retry
    assert page.is_visible("#send")
    shot(page, "chat-error-1280x800.png")


def test_api_key_is_kept_and_sent_as_bearer(page: Any, standin: StandIn) -> None:
    page.fill("#api-key", "sk-console-1")
    page.dispatch_event("#api-key", "change")
    page.fill("#prompt", FRANCE)
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg-assistant:last-of-type')?.dataset.finish !== undefined")
    assert standin.state.chat_headers[-1]["authorization"] == "Bearer sk-console-1"
    page.reload()
    page.wait_for_function(f"document.getElementById('model').value === {MODEL!r}")
    assert page.input_value("#api-key") == "sk-console-1"  # kept in localStorage
    page.evaluate("localStorage.removeItem('rustinfer.api_key')")


def test_enter_sends_and_shift_enter_adds_a_newline(page: Any, standin: StandIn) -> None:
    n = len(standin.state.chat_bodies)
    page.click("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    assert len(standin.state.chat_bodies) == n
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg-assistant .meta')?.textContent.includes('finish')")
    assert standin.state.chat_bodies[-1]["messages"][-1]["content"] == "line one\nline two"
    assert page.input_value("#prompt") == ""


def test_live_panel_updates_every_second(page: Any) -> None:
    page.wait_for_function("document.getElementById('m-gen').textContent !== 'n/a'")
    ids = ["m-running", "m-waiting", "m-kv", "m-prefix", "m-gen", "c-tput", "c-ttft"]
    read = lambda: {i: page.inner_text(f"[data-testid={i}]") for i in ids}  # noqa: E731
    first = read()
    page.wait_for_function(f"document.getElementById('m-gen').textContent !== {first['m-gen']!r}", timeout=5000)
    second = read()
    assert second["m-gen"] != first["m-gen"]
    assert second["m-kv"] != first["m-kv"]
    assert second["m-prefix"] == "40.0%"  # 40 hits per 100 queried tokens
    assert page.inner_text("#ready-pill") == "Ready"
    assert page.inner_text("#sys-backend") == "stand-in-cpu" and page.inner_text("#sys-uptime").startswith("1h 2m")
    # Throughput and TTFT are derived from two readings or more.
    page.wait_for_function("document.querySelector('[data-testid=c-tput]').textContent.endsWith('tok/s')")
    page.wait_for_function("document.querySelector('[data-testid=c-ttft]').textContent.startsWith('avg 150 ms')")
    assert "p90" in page.inner_text("[data-testid=c-ttft]")
    page.wait_for_selector("#chart-tput svg path.line", state="attached")  # a line needs two rates: three readings
    assert page.locator("#chart-requests svg path.line").count() >= 2
    page.select_option("#window", "900")
    assert page.inner_text("#chart-kv .scale-win") == "last 1 min"  # young history: the axis spans a minute
    shot(page, "live-desktop-1280x800.png")


def test_prometheus_parsing_is_robust(page: Any) -> None:
    result = page.evaluate("""() => {
      const R = window.rustinfer;
      const text = [
        '# HELP x y', '# TYPE rustinfer_num_requests_running gauge',
        'rustinfer_num_requests_running{model_name="a",note="q\\\\"uote}, x"} 2.0',
        'rustinfer_num_requests_running{model_name="b"} 3 1700000000000',
        'garbage line {', 'rustinfer_kv_cache_usage_ratio NaN',
        'rustinfer_ttft_seconds_bucket{le="0.1"} 1', 'rustinfer_ttft_seconds_bucket{le="1.0"} 3',
        'rustinfer_ttft_seconds_bucket{le="+Inf"} 4', 'rustinfer_ttft_seconds_count 4', 'rustinfer_ttft_seconds_sum 2.5',
      ].join('\\n');
      const rd = R.reading(R.parsePrometheus(text));
      return {running: rd.running, waiting: rd.waiting, gen: rd.genTokens, kvIsNaN: Number.isNaN(rd.kv),
              ttft: rd.ttft, p50: R.histogramQuantile(0.5, rd.ttft, null), p99: R.histogramQuantile(0.99, rd.ttft, null)};
    }""")
    assert result["running"] == 5 and result["waiting"] is None and result["gen"] is None
    assert result["ttft"]["count"] == 4 and result["ttft"]["sum"] == 2.5
    assert abs(result["p50"] - 0.55) < 1e-9  # rank 2 falls halfway through the (0.1, 1.0] bucket
    assert result["p99"] == 1.0  # in the +Inf bucket: the largest finite bound


def test_absent_metrics_show_na(browser: Any, tmp_path: Path) -> None:
    """An upstream without /metrics, /metrics/system or /ready: the page says n/a / unreachable, no crash."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    bare = Starlette(routes=[
        Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "m"}]})),
        Route("/metrics", lambda r: PlainTextResponse("# nothing here\nrustinfer_num_requests_running 1\n")),
        Route("/ready", lambda r: JSONResponse({"status": "loading"}, status_code=503)),
    ])
    with ServerThread(bare) as upstream, ServerThread(create_app(upstream.url)) as proxy:
        page = open_page(browser, proxy.url + "/")
        page.wait_for_function("document.getElementById('m-running').textContent === '1'")
        page.wait_for_function("document.getElementById('ready-pill').textContent === 'Not ready'")
        for i in ["m-waiting", "m-kv", "m-prefix", "m-gen", "m-preempt", "c-tput", "c-ttft", "c-kv"]:
            assert page.inner_text(f"[data-testid={i}]") == "n/a", i
        assert page.inner_text("#sys-backend") == "n/a" and page.inner_text("#sys-uptime") == "n/a"
        assert "/metrics/system n/a" in page.inner_text("#live-status")
        assert page.js_errors == []
        page.context.close()


def test_api_base_comes_from_the_meta_tag(browser: Any, standin: StandIn, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(static_dir(), site)
    html = (site / "index.html").read_text()
    (site / "index.html").write_text(html.replace('<meta name="rustinfer-api" content="">',
                                                  f'<meta name="rustinfer-api" content="{standin.url}/">'))
    # This server has the page but proxies the API to a dead port: only the meta tag can lead to the stand-in.
    with ServerThread(create_app("http://127.0.0.1:9", static=site)) as server:
        page = open_page(browser, server.url + "/")
        page.wait_for_function(f"document.getElementById('model').value === {MODEL!r}")
        assert page.evaluate("window.rustinfer.apiBase") == standin.url
        assert server.url in standin.state.seen_origins
        page.context.close()


@pytest.mark.parametrize("width,height", [(1280, 800), (390, 844)])
def test_layout(browser: Any, frontend: FrontendProcess, width: int, height: int) -> None:
    page = open_page(browser, frontend.url + "/", width, height)
    page.wait_for_function(f"document.getElementById('model').value === {MODEL!r}")
    page.fill("#prompt", FRANCE)
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg-assistant .meta')?.textContent.includes('finish: stop')")
    page.wait_for_function("document.getElementById('m-gen').textContent !== 'n/a'")

    def box(sel: str) -> dict[str, float]:
        b = page.locator(sel).bounding_box()
        assert b is not None, f"{sel} is not displayed"
        return b

    def inside(sel: str) -> None:
        b = box(sel)
        assert b["x"] >= 0 and b["y"] >= 0 and b["x"] + b["width"] <= width + 0.5 and b["y"] + b["height"] <= height + 0.5, (sel, b)

    overflow = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
    assert overflow[0] <= width and overflow[1] <= height, f"the page scrolls: {overflow}"
    for sel in ["#prompt", "#send", "#model", "#ready-pill", ".msg-assistant .bubble", "#temperature", "#max-tokens"]:
        inside(sel)
    assert box("#prompt")["width"] >= (200 if width < 500 else 500)
    tag = f"{width}x{height}"
    if width >= 1000:
        assert page.is_visible("[data-testid=live]") and not page.is_visible(".tabs")
        for sel in ["#m-running", "#m-kv", "#chart-tput", "#chart-ttft"]:
            inside(sel)
        assert box("[data-testid=live]")["x"] > box("#prompt")["x"] + box("#prompt")["width"]  # side by side
        shot(page, f"layout-{tag}.png")
        page.emulate_media(color_scheme="dark")
        shot(page, f"layout-{tag}-dark.png")
    else:
        assert not page.is_visible("[data-testid=live]")
        shot(page, f"layout-{tag}-chat.png")
        page.click("#tab-live")
        assert page.is_visible("[data-testid=live]") and not page.is_visible("#prompt")
        for sel in ["#m-running", "#m-kv", "#m-prefix"]:
            inside(sel)
        assert page.evaluate("document.querySelector('.live').scrollWidth <= document.querySelector('.live').clientWidth")
        shot(page, f"layout-{tag}-live.png")
        page.click("#tab-chat")
        assert page.is_visible("#prompt")
    assert page.js_errors == []
    page.context.close()
