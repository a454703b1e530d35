"""The console against the three real processes (`rustinfer serve` on the CPU backend with the embedded
SmolLM2): a real streamed chat, stop on a long answer, and the live panel moving. Slow: run with
`pytest -m slow tests/frontend/test_console_e2e.py`. The `smol_cluster` fixture (`.url`) comes from
tests/e2e/conftest.py through tests/frontend/conftest.py."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.frontend.browser import browser, needs_chromium, open_page  # noqa: F401
from tests.frontend.conftest import ARTIFACTS, FrontendProcess

pytestmark = [pytest.mark.slow, needs_chromium]

FRANCE = "What is the capital of France?"
LONG = "Write a very long story about a dragon who learns to cook. Make it at least a thousand words."
TILES = ["m-running", "m-waiting", "m-kv", "m-prefix", "m-gen", "m-preempt"]


@pytest.fixture(scope="module")
def console(smol_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProcess]:
    proc = FrontendProcess(smol_cluster.url, tmp_path_factory.mktemp("console-e2e") / "frontend.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


def tiles(page: Any) -> dict[str, str]:
    return page.evaluate(f"Object.fromEntries({TILES!r}.map(id => [id, document.getElementById(id).textContent]))")


def running_requests(url: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(r"^rustinfer_num_requests_running(?:\{[^}]*\})?\s+(\S+)", text, re.M)]
    return sum(values) if values else None


def wait_idle(url: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_requests(url) in (0.0, None):
            return True
        time.sleep(0.2)
    return False


def test_console_chat_stop_and_live_panel(browser: Any, console: FrontendProcess, smol_cluster: Any) -> None:
    page = open_page(browser, console.url + "/")
    page.set_default_timeout(300_000)  # the CPU backend
    page.wait_for_function("document.getElementById('model').value !== ''")
    model = page.input_value("#model")
    assert model == httpx.get(smol_cluster.url + "/v1/models").json()["data"][0]["id"]
    page.wait_for_function("document.getElementById('ready-pill').textContent === 'Ready'")
    page.wait_for_function("document.getElementById('m-running').textContent !== 'n/a'")
    before = tiles(page)

    # Greedy, short: "Paris" streams in. Count the bubble's updates to see that tokens arrive one by one.
    page.eval_on_selector("#temperature", "e => { e.value = '0'; e.dispatchEvent(new Event('input')); }")
    page.fill("#max-tokens", "32")
    page.evaluate("""() => {
      window.__updates = 0;
      new MutationObserver(() => { window.__updates++; })
        .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#prompt", FRANCE)
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg-assistant')?.dataset.finish !== undefined")
    reply = page.locator(".msg-assistant").last
    assert page.locator(".api-error").count() == 0, page.locator(".api-error").all_inner_texts()
    assert "Paris" in reply.locator(".bubble").inner_text()
    assert "finish: stop" in reply.locator(".meta").inner_text() or "finish: length" in reply.locator(".meta").inner_text()
    assert page.evaluate("window.__updates") > 5, "the answer did not stream in piece by piece"
    shot(page, "e2e-chat-1280x800.png")

    # The live panel moved: the chat ran and generated tokens since the first reading (the server counts a
    # request's tokens when it ends, so this may take the next reading or two).
    if before["m-gen"] != "n/a":
        page.wait_for_function("old => Number(document.getElementById('m-gen').textContent.replace(/,/g, '')) > old",
                               arg=int(before["m-gen"].replace(",", "")), timeout=10_000)
    else:
        page.wait_for_function("([ids, old]) => JSON.stringify(ids.map(id => document.getElementById(id).textContent)) !== old",
                               arg=[TILES, json.dumps([before[i] for i in TILES], separators=(",", ":"))], timeout=10_000)
    assert tiles(page) != before

    # Stop on a long answer: generation ends in the page, and the server drops the request.
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", LONG)
    page.keyboard.press("Enter")
    page.wait_for_function("(document.querySelectorAll('.msg-assistant')[1]?.querySelector('.bubble')?.textContent || '').length > 40")
    page.click("#stop")
    page.wait_for_function("document.querySelectorAll('.msg-assistant')[1].dataset.finish === 'stopped'", timeout=10_000)
    stopped = page.locator(".msg-assistant").last
    text = stopped.locator(".bubble").inner_text()
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.wait_for_timeout(1000)
    assert stopped.locator(".bubble").inner_text() == text, "tokens kept arriving after stop"
    assert wait_idle(smol_cluster.url), "the server kept generating after the console stopped"
    page.wait_for_function("document.getElementById('m-running').textContent === '0'", timeout=10_000)
    shot(page, "e2e-stopped-1280x800.png")
    assert page.js_errors == [], page.js_errors
    page.context.close()


def test_server_mounts_the_console_at_root(browser: Any, smol_cluster: Any) -> None:
    """With infer-frontend installed the server serves the page itself (entry point `rustinfer.static`)."""
    r = httpx.get(smol_cluster.url + "/", timeout=10)
    assert r.status_code == 200 and "rustinfer-api" in r.text, "the server does not mount the console at /"
    page = open_page(browser, smol_cluster.url + "/", 390, 844)
    page.wait_for_function("document.getElementById('model').value !== ''")
    page.wait_for_function("document.getElementById('ready-pill').textContent === 'Ready'")
    page.click("#tab-live")
    page.wait_for_function("document.getElementById('m-kv').textContent !== 'n/a'")
    shot(page, "e2e-mounted-390x844-live.png")
    assert page.js_errors == [], page.js_errors
    page.context.close()
