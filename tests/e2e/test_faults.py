"""Fault injection against the three real processes on a tiny random checkpoint: a worker killed mid-stream,
200 randomly disconnecting clients, overload (429), request timeouts (504 / error event), SIGTERM draining of
the server and of the scheduler, the body size limit (413) and `x-request-id`.

Every wait is bounded: a test that would hang fails instead. A test that needs requests in flight holds them there
itself, by stopping the worker (`cluster.freeze()`, SIGSTOP) until it has acted, never by a token count long
enough on this machine: on a faster one (or a slower one) such a count finished too early (or too late).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import DirectCluster, Frozen, ServedCluster

MODEL = "tiny"
# greedy (the CPU reference sampler's fast path), past EOS: a request runs exactly max_tokens steps
LONG = {"model": MODEL, "prompt": [1, 450, 7042, 282], "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------ helpers


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {"name{labels}": value}, the labels as prometheus_client prints them (sorted by name)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def requests_held(url: str, n: int) -> bool:
    """The server has `n` generation requests open and the scheduler holds them all (its figures come with its
    Pong, at most a heartbeat old): a signal now reaches none of them before the scheduler has it."""
    m = scrape(url)
    return (m["rustinfer_num_requests_inflight"] == n
            and m["rustinfer_num_requests_running"] + m["rustinfer_num_requests_waiting"] == n)


def kv_settled(url: str) -> bool:
    m = scrape(url)
    return (m["rustinfer_num_requests_running"] == 0 and m["rustinfer_num_requests_waiting"] == 0
            and m["rustinfer_num_requests_inflight"] == 0
            and m["rustinfer_kv_cache_free_blocks"] + m["rustinfer_kv_cache_cached_blocks"]
            == m["rustinfer_kv_cache_total_blocks"] > 0)


@dataclass
class Call:
    """One request run on a thread: the status, the JSON body or the SSE payloads with their arrival times."""

    status: int | None = None
    body: Any = None
    events: list[tuple[float, Any]] = field(default_factory=list)
    error: BaseException | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    finished_at: float | None = None

    @property
    def payloads(self) -> list[Any]:
        return [e for _, e in self.events]

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"request still open after {timeout} s"
        if self.error is not None:
            raise self.error


def start_call(url: str, path: str, body: dict[str, Any], *, stream: bool, timeout: float = 90,
               on_first_token: Callable[[], None] | None = None) -> Call:
    """`on_first_token` runs on the call's own thread as the first token arrives: a test that acts there does not
    depend on its main thread being scheduled before the request finishes."""
    call = Call()

    def run() -> None:
        try:
            with httpx.Client(timeout=timeout) as client:
                if not stream:
                    resp = client.post(f"{url}{path}", json=body)
                    call.status, call.body = resp.status_code, resp.json()
                    return
                with client.stream("POST", f"{url}{path}", json=body | {"stream": True}) as resp:
                    call.status = resp.status_code
                    for line in resp.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        payload = data if data == "[DONE]" else json.loads(data)
                        call.events.append((time.monotonic(), payload))
                        if isinstance(payload, dict) and payload.get("choices") and not call.first_token.is_set():
                            if on_first_token is not None:
                                on_first_token()
                            call.first_token.set()
        except BaseException as exc:  # reported by join()
            call.error = exc
        finally:
            call.finished_at = time.monotonic()
            call.first_token.set()

    call.thread = threading.Thread(target=run, daemon=True)
    call.thread.start()
    return call


@dataclass
class MidFlight:
    stream: Call
    plain: list[Call]
    signalled_at: list[float]
    worker: Frozen


def signal_mid_flight(cluster: ServedCluster, proc: Any, n_plain: int, n_tokens: int, *,
                      resume: bool = True) -> MidFlight:
    """Sends SIGTERM to `proc` while one stream and `n_plain` plain requests are in flight, however fast the
    machine: the worker is stopped first, the requests are sent, and the signal goes once the server and the
    scheduler hold all of them; none can have finished. Then the worker resumes (with `resume=False` the test
    resumes it: `flight.worker.resume()`). The cluster's worker_timeout_secs must outlast the stop."""
    url = cluster.url
    body = LONG | {"max_tokens": n_tokens}
    worker = cluster.freeze()
    try:
        plain = [start_call(url, "/v1/completions", body, stream=False) for _ in range(n_plain)]
        stream = start_call(url, "/v1/completions", body, stream=True)
        wait_for(f"{n_plain + 1} requests held", lambda: requests_held(url, n_plain + 1), 60, 0.02)
        proc.send_signal(signal.SIGTERM)
        signalled_at = [time.monotonic()]
    except BaseException:
        worker.resume()
        raise
    if resume:
        worker.resume()
    return MidFlight(stream, plain, signalled_at, worker)


def assert_drained(flight: MidFlight, n_tokens: int, timeout: float = 120) -> None:
    """Every request of `flight` completed in full, the stream and the plain ones after the signal."""
    for call in [flight.stream, *flight.plain]:
        call.join(timeout)
    signalled_at = flight.signalled_at[0]
    for p in flight.plain:
        assert p.status == 200, p.body
        assert p.body["usage"]["completion_tokens"] == n_tokens
        assert p.body["choices"][0]["finish_reason"] == "length"
        assert p.finished_at is not None and p.finished_at > signalled_at, "a request had finished before the signal"
    payloads = flight.stream.payloads
    assert payloads[-1] == "[DONE]" and not any(isinstance(p, dict) and "error" in p for p in payloads)
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert flight.stream.events[-1][0] > signalled_at, "the stream had finished before the signal"


def assert_error_then_done(call: Call, code: str) -> None:
    payloads = call.payloads
    assert call.status == 200
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = payloads[-2]
    assert isinstance(error, dict) and "error" in error, payloads[-3:]
    assert error["error"]["code"] == code, error
    assert not any(isinstance(p, dict) and "error" in p for p in payloads[:-2])


# ------------------------------------------------------------------ a worker killed mid-stream


def hold_mid_stream(cluster: ServedCluster, n_streams: int, n_plain: int) -> tuple[list[Call], list[Call], Frozen]:
    """Streams and plain requests held in flight by the test: the first stream stops the worker at its first token
    (it is mid-stream; 3000 tokens cannot all come in the moment before the stop), the others are sent while the
    worker is stopped, and this returns once the server and the scheduler hold all of them. The caller resumes or
    kills the worker."""
    url = cluster.url
    body = LONG | {"max_tokens": 3000}
    frozen: list[Frozen] = []
    first = start_call(url, "/v1/completions", body, stream=True,
                       on_first_token=lambda: frozen.append(cluster.freeze()))
    assert first.first_token.wait(90) and frozen, f"no token streamed: {first.status} {first.error!r}"
    try:
        streams = [first, *(start_call(url, "/v1/completions", body, stream=True) for _ in range(n_streams - 2))]
        if n_streams > 1:
            streams.append(start_call(url, "/v1/chat/completions",
                                      {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "temperature": 0, "ignore_eos": True, "max_tokens": 3000}, stream=True))
        plain = [start_call(url, "/v1/completions", body, stream=False) for _ in range(n_plain)]
        wait_for(f"{n_streams + n_plain} requests held", lambda: requests_held(url, n_streams + n_plain), 60, 0.02)
    except BaseException:
        frozen[0].resume()
        raise
    return streams, plain, frozen[0]


def ended_at(call: Call) -> float:
    """When the request's outcome reached the client: a stream's last event before [DONE], a plain one's answer."""
    if call.events:
        return call.events[-2][0] if call.payloads[-1] == "[DONE]" and len(call.events) > 1 else call.events[-1][0]
    assert call.finished_at is not None
    return call.finished_at


def test_worker_killed_mid_stream(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Without the launcher: a killed worker is noticed at once (its connection closes), not after
    worker_timeout_secs (60 s here, so that a test waiting for it would fail): every request ends within 3 s."""
    cluster = DirectCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=1024, block_size=4,
                            worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    try:
        url = cluster.url
        streams, plain, _ = hold_mid_stream(cluster, 3, 2)
        assert all(not any(p == "[DONE]" for p in s.payloads) for s in streams), "a stream ended before the kill"

        os.kill(cluster.pids()["worker"], signal.SIGKILL)  # a stopped process dies of SIGKILL too
        killed_at = time.monotonic()

        for call in streams + plain:
            call.join(timeout=30)
        for s in streams:
            assert_error_then_done(s, "worker_lost")
            assert s.payloads[-2]["error"]["type"] == "server_error"
        for p in plain:
            assert p.status == 503, p.body
            assert p.body["error"]["code"] == "worker_lost" and p.body["error"]["type"] == "server_error"
        late = [round(ended_at(c) - killed_at, 2) for c in streams + plain]
        assert max(late) < 3.0, late

        wait_for("/ready 503", lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, 5)
        assert "worker" in httpx.get(f"{url}/ready", timeout=5).json()["detail"]
        resp = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 2}, timeout=10)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_error"
        metrics = scrape(url)
        assert metrics["rustinfer_scheduler_ready"] == 0
        assert metrics["rustinfer_num_requests_inflight"] == 0
        lost = sum(v for k, v in metrics.items()
                   if k.startswith("rustinfer_request_errors_total") and 'code="worker_lost"' in k)
        assert lost == 5
        alive = cluster.pids()
        assert "server" in alive and "scheduler" in alive and "worker" not in alive
    finally:
        cluster.stop()


# ------------------------------------------------------------------ 200 random disconnects


async def _one_flaky_request(client: httpx.AsyncClient, url: str, rng: random.Random, stats: dict[str, int]) -> None:
    prefix = rng.choice([[1, 450, 7042, 282, 4649, 314, 22, 33], [1, 22, 33, 44, 55, 66, 77, 88], [1, 9, 8, 7]])
    prompt = prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(0, 12))]
    max_tokens = rng.randrange(2, 40)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    mode = rng.random()
    if mode < 0.15:  # non-streaming, the client gives up after a random time
        try:
            await client.post(f"{url}/v1/completions", json=body, timeout=rng.uniform(0.01, 0.5))
            stats["completed"] += 1
        except httpx.TimeoutException:
            stats["gave_up"] += 1
        return
    close_after = rng.randrange(0, max_tokens + 4) if mode < 0.9 else None  # else: read to the end
    async with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        async for line in resp.aiter_lines():
            if close_after is not None and seen >= close_after:
                stats["closed"] += 1
                return  # leaving the block closes the connection mid-stream
            if line.startswith("data: "):
                seen += 1
        stats["completed"] += 1


def test_random_disconnects_free_every_block(tiny_cluster: ServedCluster) -> None:
    url = tiny_cluster.url
    wait_for("an idle cluster", lambda: kv_settled(url), 30)
    before = scrape(url)
    rng = random.Random(6)
    stats = {"completed": 0, "closed": 0, "gave_up": 0}

    async def main() -> None:
        limits = httpx.Limits(max_connections=24, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits) as client:
            sem = asyncio.Semaphore(24)

            async def guarded(i: int) -> None:
                async with sem:
                    await asyncio.sleep(rng.uniform(0, 0.02))
                    await _one_flaky_request(client, url, random.Random(i), stats)

            await asyncio.wait_for(asyncio.gather(*(guarded(i) for i in range(200))), timeout=150)

    asyncio.run(main())
    assert sum(stats.values()) == 200
    assert stats["closed"] > 50 and stats["completed"] > 10, stats
    wait_for("every KV block free or cached", lambda: kv_settled(url), 30)
    after = scrape(url)
    assert after["rustinfer_kv_cache_free_blocks"] + after["rustinfer_kv_cache_cached_blocks"] == \
        after["rustinfer_kv_cache_total_blocks"]
    aborted = 'rustinfer_request_success_total{endpoint="/v1/completions",finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) > 0
    # and the cluster still serves
    resp = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 3}, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------ metrics


def test_metrics_cover_the_request_lifecycle(tiny_cluster: ServedCluster) -> None:
    url = tiny_cluster.url
    before = scrape(url)
    prompt = [1, 450, 7042, 282, 4649]
    ok = httpx.post(f"{url}/v1/completions", json=LONG | {"prompt": prompt, "max_tokens": 5}, timeout=30)
    assert ok.status_code == 200
    bad = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 0}, timeout=30)
    assert bad.status_code == 400
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions",
                           json=LONG | {"prompt": prompt, "max_tokens": 200, "stream": True}) as resp:
            next(resp.iter_lines())  # then leave: aborted
    # The scheduler's counters reach /metrics with its next Pong: wait until they show this test's steps, so
    # that the KV check below reads a Pong from after the abort, not a stale one from before the stream.
    steps_before = before.get("rustinfer_scheduler_steps_total", 0)
    wait_for("the scheduler's counters caught up",
             lambda: scrape(url).get("rustinfer_scheduler_steps_total", 0) - steps_before >= 6, 20)
    wait_for("the aborted request released", lambda: kv_settled(url), 20)
    after = scrape(url)

    def grew(key: str, by: float = 1) -> None:
        assert after.get(key, 0) - before.get(key, 0) >= by, (key, before.get(key), after.get(key))

    grew('rustinfer_http_requests_total{endpoint="/v1/completions",method="POST",status="200"}', 2)
    grew('rustinfer_http_requests_total{endpoint="/v1/completions",method="POST",status="400"}')
    grew('rustinfer_request_success_total{endpoint="/v1/completions",finish_reason="length"}')
    grew('rustinfer_request_success_total{endpoint="/v1/completions",finish_reason="abort"}')
    grew("rustinfer_prompt_tokens_total", 2 * len(prompt))
    grew("rustinfer_generation_tokens_total", 6)
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds"):
        grew(f"rustinfer_{histogram}_count")
        assert after[f'rustinfer_{histogram}_bucket{{le="+Inf"}}'] == after[f"rustinfer_{histogram}_count"]
    assert after["rustinfer_scheduler_ready"] == 1
    assert after["rustinfer_kv_cache_total_blocks"] == 128
    grew("rustinfer_scheduler_steps_total", 6)
    grew("rustinfer_prefix_cache_queries_tokens_total", len(prompt))
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "kv_cache_free_blocks",
                  "kv_cache_cached_blocks", "num_preemptions_total", "prefix_cache_hits_tokens_total"):
        assert f"rustinfer_{gauge}" in after


# ------------------------------------------------------------------ overload and timeouts


@pytest.fixture(scope="module")
def limited_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    cluster = ServedCluster(tmp_path_factory.mktemp("limited"), model=str(tiny_model_dir), model_name=MODEL,
                            num_blocks=2048, block_size=4, max_inflight_requests=2, worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    yield cluster
    cluster.stop()


def test_overload_429(limited_cluster: ServedCluster) -> None:
    url = limited_cluster.url
    worker = limited_cluster.freeze()  # the two streams stay in flight until the test lets them go
    try:
        streams = [start_call(url, "/v1/completions", LONG | {"max_tokens": 64}, stream=True) for _ in range(2)]
        wait_for("2 requests in flight", lambda: scrape(url)["rustinfer_num_requests_inflight"] == 2, 60, 0.02)
        over = [httpx.post(f"{url}{path}", json=body, timeout=10)
                for path, body in (("/v1/completions", LONG | {"max_tokens": 2}),
                                   ("/v1/chat/completions", {"model": MODEL,
                                                             "messages": [{"role": "user", "content": "x"}]}))]
    finally:
        worker.resume()
    for resp in over:
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert resp.headers["retry-after"] == "1"
    for s in streams:  # both complete, then the server serves again
        s.join(timeout=120)
        assert s.payloads[-1] == "[DONE]" and s.payloads[-2]["choices"][0]["finish_reason"] == "length"
    resp = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 2}, timeout=30)
    assert resp.status_code == 200


@pytest.fixture(scope="module")
def timeout_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    """A 1 s request timeout; the tests stop the worker so that their request is still open at the deadline."""
    cluster = ServedCluster(tmp_path_factory.mktemp("timeout"), model=str(tiny_model_dir), model_name=MODEL,
                            num_blocks=1024, block_size=4, request_timeout_secs=1.0, worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    yield cluster
    cluster.stop()


def test_stream_timeout_ends_with_an_error_event(timeout_cluster: ServedCluster) -> None:
    """A stream still running at request_timeout_secs ends with an error event (`timeout`) then [DONE]. The worker
    is stopped at its first token, so the stream is mid-way at the deadline however fast the machine."""
    url = timeout_cluster.url
    frozen: list[Frozen] = []
    s = start_call(url, "/v1/completions", LONG | {"max_tokens": 3000}, stream=True,
                   on_first_token=lambda: frozen.append(timeout_cluster.freeze()))
    try:
        s.join(timeout=30)
    finally:
        for f in frozen:
            f.resume()
    assert frozen, "no token streamed"
    assert_error_then_done(s, "timeout")
    assert s.events[-1][0] - s.events[0][0] < 20
    wait_for("the timed-out request released", lambda: kv_settled(url), 20)


def test_non_streaming_timeout_is_504(timeout_cluster: ServedCluster) -> None:
    url = timeout_cluster.url
    started = time.monotonic()
    worker = timeout_cluster.freeze()  # no step runs: the request is still open at the deadline
    try:
        resp = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 3000}, timeout=30)
    finally:
        worker.resume()
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "timeout" and resp.json()["error"]["type"] == "server_error"
    assert 0.9 < time.monotonic() - started < 20
    wait_for("the timed-out request aborted", lambda: kv_settled(url), 20)
    m = scrape(url)
    assert m['rustinfer_http_requests_total{endpoint="/v1/completions",method="POST",status="504"}'] >= 1


# ------------------------------------------------------------------ body limit, request ids


def test_body_over_the_limit_is_413(tiny_cluster: ServedCluster) -> None:
    url = tiny_cluster.url
    limit = 4 * 1024 * 1024  # the default max_request_body_bytes
    big = {"model": MODEL, "prompt": "a" * (limit + 10), "max_tokens": 1}
    resp = httpx.post(f"{url}/v1/completions", json=big, headers={"x-request-id": "big-1"}, timeout=30)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert resp.headers["x-request-id"] == "big-1"

    def chunks() -> Iterator[bytes]:  # no content-length: the limit applies while reading
        raw = json.dumps(big).encode()
        for i in range(0, len(raw), 1 << 20):
            yield raw[i:i + (1 << 20)]

    resp = httpx.post(f"{url}/tokenize", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    # a body under the limit is served
    ok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "ab " * 1000}, timeout=30)
    assert ok.status_code == 200 and ok.json()["count"] > 0
    assert scrape(url)['rustinfer_http_requests_total{endpoint="/v1/completions",method="POST",status="413"}'] >= 1


def test_request_id_is_echoed(tiny_cluster: ServedCluster) -> None:
    url = tiny_cluster.url
    body = LONG | {"max_tokens": 2}
    cases = [
        ("POST", "/v1/completions", body, 200),
        ("POST", "/v1/completions", body | {"max_tokens": 0}, 400),
        ("POST", "/v1/completions", body | {"model": "nope"}, 404),
        ("GET", "/v1/no-such-route", None, 404),
        ("GET", "/v1/models", None, 200),
        ("GET", "/metrics", None, 200),
    ]
    with httpx.Client(timeout=30) as client:
        for i, (method, path, payload, status) in enumerate(cases):
            rid = f"client-id-{i}"
            resp = client.request(method, f"{url}{path}", json=payload, headers={"x-request-id": rid})
            assert resp.status_code == status, (path, resp.text)
            assert resp.headers["x-request-id"] == rid
        with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True},
                           headers={"x-request-id": "stream-id"}) as resp:
            assert resp.headers["x-request-id"] == "stream-id"
            resp.read()
        fresh = client.get(f"{url}/health").headers["x-request-id"]
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        bad = client.get(f"{url}/health", headers={"x-request-id": "x" * 300}).headers["x-request-id"]
        assert bad != "x" * 300 and len(bad) == 32


# ------------------------------------------------------------------ SIGTERM drains


def test_sigterm_to_rustinfer_serve_drains(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rustinfer serve` forwards SIGTERM so that requests in flight finish: server and scheduler drain, the
    scheduler stops the worker, and the launcher exits 0."""
    cluster = ServedCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=2048, block_size=4,
                            shutdown_timeout_secs=60.0, worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    try:
        children = cluster.pids()
        assert cluster.proc is not None
        n = 64
        assert_drained(signal_mid_flight(cluster, cluster.proc, 1, n), n)
        assert cluster.proc.wait(timeout=70) == 0, cluster.log()
        wait_for("every child gone", lambda: not any(Path(f"/proc/{pid}").exists() for pid in children.values()), 10)
    finally:
        cluster.stop()


def test_sigterm_to_rustinfer_serve_mid_burst_fails_no_accepted_request(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGTERM while a burst of requests is still arriving: a request the server accepted completes in full, one
    it did not accept is refused by the server. The launcher drains the server before it signals the scheduler;
    signalled together, the scheduler refused requests the server had accepted but not yet forwarded."""
    cluster = ServedCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=1024, block_size=4,
                            shutdown_timeout_secs=60.0)
    cluster.start(timeout=300)
    try:
        assert cluster.proc is not None
        n = 40
        stream = start_call(cluster.url, "/v1/completions", LONG | {"max_tokens": n}, stream=True,
                            on_first_token=lambda: cluster.proc.send_signal(signal.SIGTERM))  # type: ignore[union-attr]
        burst = [start_call(cluster.url, "/v1/completions", LONG | {"max_tokens": n}, stream=False) for _ in range(16)]
        stream.join(90)
        assert stream.payloads[-2]["choices"][0]["finish_reason"] == "length" and stream.payloads[-1] == "[DONE]"
        for call in burst:
            assert call.thread is not None
            call.thread.join(90)
            assert not call.thread.is_alive(), "request still open after 90 s"
            if call.status == 200:
                assert call.body["usage"]["completion_tokens"] == n, call.body
            else:  # never got into the server: refused connection or the server's own 503
                assert isinstance(call.error, httpx.TransportError) or (
                    call.status == 503 and call.body["error"]["code"] == "server_shutdown"), (call.status, call.body)
        assert cluster.proc.wait(timeout=70) == 0, cluster.log()
    finally:
        cluster.stop()


def test_server_drain_deadline_ends_open_requests_with_server_shutdown(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Requests still running at the server's drain deadline end with the OpenAI-format `server_shutdown` error
    (JSON 503; an error event then [DONE] on a stream) — not a bare 500 from uvicorn cancelling them — and are
    aborted at the scheduler, which frees their KV blocks for the next server."""
    cluster = DirectCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=2048, block_size=4,
                            shutdown_timeout_secs=1.0, worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    try:
        url = cluster.url
        n = 64
        server = cluster.procs["server"]
        flight = signal_mid_flight(cluster, server, 1, n, resume=False)  # stopped until the server's deadline
        try:
            for call in [flight.stream, *flight.plain]:
                call.join(60)
        finally:
            flight.worker.resume()
        plain = flight.plain[0]
        assert plain.status == 503 and plain.body["error"]["code"] == "server_shutdown", (plain.status, plain.body)
        assert_error_then_done(flight.stream, "server_shutdown")
        assert server.wait(timeout=30) == 0
        cluster.restart("server", timeout=60)
        wait_for("the aborted requests' KV blocks free", lambda: kv_settled(url), 30)
    finally:
        cluster.stop()


def test_sigterm_drains_server_then_scheduler(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = DirectCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=2048, block_size=4,
                            shutdown_timeout_secs=60.0, worker_timeout_secs=60.0)
    cluster.start(timeout=300)
    try:
        url = cluster.url
        n = 64
        # 1. the server: in-flight requests complete, then it exits 0
        server = cluster.procs["server"]
        assert_drained(signal_mid_flight(cluster, server, 2, n), n)
        assert server.wait(timeout=30) == 0

        # 2. a fresh server joins the running scheduler and worker
        cluster.restart("server", timeout=60)

        # 3. the scheduler: it finishes what it runs, refuses new work, stops the worker, exits 0
        scheduler = cluster.procs["scheduler"]
        flight = signal_mid_flight(cluster, scheduler, 2, n, resume=False)
        try:  # refused while the three still run
            refused = httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 2}, timeout=30)
        finally:
            flight.worker.resume()
        assert refused.status_code == 503, refused.text
        assert_drained(flight, n)
        assert scheduler.wait(timeout=30) == 0
        assert cluster.procs["worker"].wait(timeout=30) == 0
        wait_for("/ready 503", lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, 15)
        assert cluster.procs["server"].poll() is None
    finally:
        cluster.stop()
