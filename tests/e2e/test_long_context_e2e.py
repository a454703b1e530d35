"""Prompt lengths at every size boundary up to max_model_len, through the three real processes (CPU backend):
small limits (max_model_len 64 = 16 blocks of 4, chunks of 17, 24 tokens per step) make each boundary cheap to
cross. Completions with token-id prompts, streamed and not, and a chat request that fills the context, all sent
at once so prefill chunks share steps with running decodes and later prompts hit the prefix cache. The oracle is
the in-process eager runner on the same checkpoint, each prompt prefilled in one piece."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.e2e.sse import stream_events

MODEL = "tiny"
BLOCK_SIZE, MAX_MODEL_LEN, CHUNK, BATCH_TOKENS = 4, 64, 17, 24
# boundary -1 / 0 / +1 of: a block, the chunk size, the step budget, max_model_len (the longest prompt is 63)
LENGTHS = [3, 4, 5, 16, 17, 18, 23, 24, 25, 62, 63]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    c = ServedCluster(tmp_path_factory.mktemp("longctx"), model=str(tiny_model_dir), model_name=MODEL,
                      block_size=BLOCK_SIZE, num_blocks=256, max_model_len=MAX_MODEL_LEN,
                      chunked_prefill_size=CHUNK, max_batch_tokens=BATCH_TOKENS, request_timeout_secs=120.0,
                      idle_prefill_uses_step_budget=False)  # the chunk boundaries, alone too
    c.start(timeout=300)
    yield c
    c.stop()


def prompt_of(n: int) -> list[int]:
    """Prompts share their first 8 tokens (two pages: prefix-cache hits once the first prompt has run)."""
    return [100 + j for j in range(min(n, 8))] + [(977 * n + 31 * j) % 40000 + 300 for j in range(max(0, n - 8))]


def reference(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from tests.worker.tiny_checkpoints import Engine

    engine = Engine.open(model_dir, block_size=BLOCK_SIZE, num_blocks=40)
    seq = engine.new_seq(0, prompt)
    engine.step([(seq, len(prompt))])
    engine.decode([seq], new_tokens - 1)
    return seq.token_ids[len(prompt):]


def test_every_boundary_length_through_the_three_processes(cluster: ServedCluster, tiny_model_dir: Path) -> None:
    results: dict[str, Any] = {}

    def body(n: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": prompt_of(n), "temperature": 0, "max_tokens": MAX_MODEL_LEN - n,
                "ignore_eos": True, "return_token_ids": True}

    def plain(n: int) -> None:
        results[f"plain{n}"] = httpx.post(f"{cluster.url}/v1/completions", json=body(n), timeout=300)

    def streamed(n: int) -> None:
        with httpx.Client() as client:
            streamed_body = {**body(n), "stream": True, "return_token_ids": False}  # ids: non-streaming only
            results[f"stream{n}"] = stream_events(client, f"{cluster.url}/v1/completions", streamed_body)

    def chat() -> None:  # no max_tokens: the rest of the context
        results["chat"] = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count: " + " ".join(str(i) for i in range(12))}]})

    threads = [threading.Thread(target=plain, args=(n,)) for n in LENGTHS]
    threads += [threading.Thread(target=streamed, args=(n,)) for n in (17, 24, 63)]
    threads.append(threading.Thread(target=chat))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for n in LENGTHS:
        resp = results[f"plain{n}"]
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "length", (n, choice)
        assert choice["token_ids"] == reference(tiny_model_dir, prompt_of(n), MAX_MODEL_LEN - n), n
    for n in (17, 24, 63):
        events = results[f"stream{n}"]
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == results[f"plain{n}"].json()["choices"][0]["text"], n
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
    resp = results["chat"]
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN, usage
    # one past the limit is refused, the cluster serves on
    too_long = httpx.post(f"{cluster.url}/v1/completions", json=body(MAX_MODEL_LEN - 1) | {"max_tokens": 2},
                          timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
