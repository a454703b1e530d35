"""Fault containment through the three real processes (CPU backend): a step that fails with a Python error fails
the requests of that step only — the poisoned request and a stream decoding beside it in the same step (by
design everything in a failed step fails: one forward serves them all) — with clear errors, and the engine goes
on: a request afterwards gets the tokens it got before, from the same worker process (not restarted).

The failure is triggered by a client through the test-only `INFER_WORKER_FAULT_ON_TOKEN` (a prompt holding that
token id fails the step that computes it; see infer_worker/application/fault_injection.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster

MODEL = "tiny"
FAULT = 4242


def complete(cluster: ServedCluster, prompt: list[int], max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
        "return_token_ids": True})


def test_a_failed_step_fails_its_requests_and_the_worker_serves_on(tmp_path: Path, tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_WORKER_FAULT_ON_TOKEN", str(FAULT))
    cluster = ServedCluster(tmp_path, model=str(tiny_model_dir), model_name=MODEL, num_blocks=2048, block_size=4,
                            request_timeout_secs=120.0)
    cluster.start(timeout=300)
    try:
        worker = cluster.pids()["worker"]
        good = [100 + i for i in range(20)]
        before = complete(cluster, good)
        assert before.status_code == 200, before.text
        reference = before.json()["choices"][0]["token_ids"]

        events: list[Any] = []
        started = threading.Event()

        def stream() -> None:  # decodes for a long time: it shares the poisoned request's step (on a loaded 2-core
            # machine 2,000 tokens of the tiny model once ended before the poisoned request was scheduled)
            body = {"model": MODEL, "prompt": [7, 8, 9], "temperature": 0, "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(60), "the stream never started"
        bad = complete(cluster, [1, 2, 3, FAULT, 5])
        thread.join(timeout=120)
        assert not thread.is_alive()

        assert bad.status_code == 500, bad.text
        error = bad.json()["error"]
        assert error["code"] == "step_failed", error
        assert "the worker failed step" in error["message"] and "InjectedFault" in error["message"], error
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        assert any("error" in p for p in payloads), events[-3:]  # the stream ends with an error event
        stream_error = next(p["error"] for p in payloads if "error" in p)
        assert stream_error["code"] == "step_failed", stream_error

        after = complete(cluster, good)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["token_ids"] == reference
        assert cluster.pids()["worker"] == worker  # the same process: contained, not restarted
        assert httpx.get(f"{cluster.url}/ready", timeout=10).status_code == 200
        assert "step " in cluster.log() and "failed, its" in cluster.log()
    finally:
        cluster.stop()
