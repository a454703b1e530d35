"""Qwen3.5 served end to end: the three real processes on the CPU backend, on a tiny random hybrid checkpoint in
the published layout (written here by transformers, with the embedded SmolLM2's tokenizer and chat template).
Greedy tokens of concurrent requests equal transformers' own generate, a streamed chat completion equals the
unstreamed one, and the scheduler says it turned prefix caching off for the hybrid model."""

from __future__ import annotations

import concurrent.futures as cf
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.e2e.sse import stream_events

MODEL = "tiny-qwen3.5"
VOCAB = 49152  # the SmolLM2 tokenizer's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[tuple[ServedCluster, object]]:
    from tests.worker.qwen3_5_checkpoints import write_qwen3_5

    model_dir = tmp_path_factory.mktemp("qwen3_5-e2e") / "model"
    hf = write_qwen3_5(model_dir, seed=21, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    for name in TOKENIZER_FILES:
        if (embedded_model_dir / name).exists():
            shutil.copy(embedded_model_dir / name, model_dir / name)
    # chunks of 16 prompt tokens and 8 KV blocks of 16 a sequence at most: prompts span several prefill chunks
    cluster = ServedCluster(tmp_path_factory.mktemp("qwen3_5-cluster"), model=str(model_dir), model_name=MODEL,
                            block_size=16, chunked_prefill_size=16, max_batch_tokens=32, max_batch_seqs=4,
                            max_model_len=128, enable_prefix_caching=True, idle_prefill_uses_step_budget=False)
    cluster.start()
    try:
        yield cluster, hf
    finally:
        cluster.stop()


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(100, VOCAB) for _ in range(20 + 9 * i)] for i in range(4)]


def test_concurrent_greedy_completions_are_transformers_tokens(served) -> None:
    from tests.worker.tiny_checkpoints import hf_greedy

    cluster, hf = served

    def complete(prompt: list[int]) -> list[int]:
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    prompts = _prompts()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(complete, prompts))
    assert got == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert "prefix caching is off" in cluster.log()


def test_streamed_chat_completion_equals_the_unstreamed_one(served) -> None:
    cluster, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with httpx.Client() as client:
        whole = client.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
        assert whole.status_code == 200, whole.text
        events = stream_events(client, f"{cluster.url}/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 1  # streamed
    assert finishes == ["length"]
    assert text == whole.json()["choices"][0]["message"]["content"] and text
