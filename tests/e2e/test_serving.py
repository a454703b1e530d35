"""The default deployment end to end: three real processes, real ZMQ IPC, the embedded SmolLM2 on the CPU."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest

from infer_protocol.config import Config
from tests.e2e.cluster import ServedCluster
from tests.e2e.sse import stream_events

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat(cluster: ServedCluster, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 32} | extra
    return httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)


def test_models_lists_the_embedded_model(smol_cluster: ServedCluster) -> None:
    data = httpx.get(f"{smol_cluster.url}/v1/models").json()
    assert [m["id"] for m in data["data"]] == [MODEL]
    assert httpx.get(f"{smol_cluster.url}/health").status_code == 200
    assert httpx.get(f"{smol_cluster.url}/ready").status_code == 200


def test_capital_of_france(smol_cluster: ServedCluster) -> None:
    resp = chat(smol_cluster, FRANCE)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and 0 < usage["completion_tokens"] <= 32
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_streaming_chat_matches_non_streaming(smol_cluster: ServedCluster) -> None:
    reference = chat(smol_cluster, FRANCE).json()
    with httpx.Client() as client:
        events = stream_events(
            client, f"{smol_cluster.url}/v1/chat/completions",
            {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 32, "stream": True,
             "stream_options": {"include_usage": True}},
        )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == reference["usage"]
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == reference["choices"][0]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_completions_with_string_and_token_prompts(smol_cluster: ServedCluster) -> None:
    url = f"{smol_cluster.url}/v1/completions"
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
    by_text = httpx.post(url, json=body, timeout=300).json()
    assert by_text["object"] == "text_completion"
    assert "Paris" in by_text["choices"][0]["text"]
    ids = httpx.post(f"{smol_cluster.url}/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}).json()
    by_ids = httpx.post(url, json=body | {"prompt": ids["tokens"]}, timeout=300).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["choices"][0]["finish_reason"] == "length"
    assert by_ids["usage"]["completion_tokens"] == 8


def test_batched_completion_prompts_equal_separate_requests(smol_cluster: ServedCluster) -> None:
    """A list of prompts answers what one request per prompt answers, choice for choice (greedy, and seeded
    sampling with n = 2: each prompt's choices draw with the seeds its own request would)."""
    url = f"{smol_cluster.url}/v1/completions"
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 5, "n": 2}):
        body = {"model": MODEL, "max_tokens": 10, "ignore_eos": True} | params
        batched = httpx.post(url, json=body | {"prompt": prompts}, timeout=300).json()
        separate = [httpx.post(url, json=body | {"prompt": p}, timeout=300).json() for p in prompts]
        assert [c["text"] for c in batched["choices"]] == [c["text"] for r in separate for c in r["choices"]]
        assert [c["index"] for c in batched["choices"]] == list(range(len(batched["choices"])))
        assert batched["usage"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in separate)
        assert batched["usage"]["completion_tokens"] == 10 * len(batched["choices"])


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(smol_cluster: ServedCluster) -> None:
    url = f"{smol_cluster.url}/v1/completions"
    prompt = "A unique prompt for the cached-token count: " + " ".join(f"w{i}" for i in range(60))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = httpx.post(url, json=body, timeout=300).json()["usage"]
    second = httpx.post(url, json=body, timeout=300).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"] and 0 < cached < first["prompt_tokens"]
    # the cache holds whole pages: all of the prompt but its last, partial page (the last token is always computed)
    block = Config().block_size  # smol_cluster keeps the default
    assert cached == (first["prompt_tokens"] - 1) // block * block


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Translate 'good morning' to Spanish.",
    "What is the largest planet?",
]


def test_eight_concurrent_streams_complete_correctly(smol_cluster: ServedCluster) -> None:
    references = [chat(smol_cluster, [{"role": "user", "content": q}]).json()["choices"][0]["message"]["content"]
                  for q in QUESTIONS]

    def run(question: str) -> str:
        with httpx.Client() as client:
            events = stream_events(client, f"{smol_cluster.url}/v1/chat/completions",
                                   {"model": MODEL, "messages": [{"role": "user", "content": question}],
                                    "temperature": 0, "max_tokens": 32, "stream": True})
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])

    with cf.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        texts = list(pool.map(run, QUESTIONS))
    assert texts == references


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b"{not json", 400, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, None),
    ("max_tokens 0", "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "max_tokens": 0}, 400, None),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": FRANCE}, 404, "model_not_found"),
    ("too long", "/v1/completions", {"model": MODEL, "prompt": "hello " * 3000}, 400, "context_length_exceeded"),
]


def test_bad_input_is_refused_while_others_run(smol_cluster: ServedCluster) -> None:
    question = [{"role": "user", "content": "Write a haiku about the sea."}]
    reference = chat(smol_cluster, question, max_tokens=48).json()["choices"][0]["message"]["content"]
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            lambda: chat(smol_cluster, question, max_tokens=48).json()["choices"][0]["message"]["content"]
        )
        for name, path, body, status, code in BAD_REQUESTS:
            if isinstance(body, bytes):
                resp = httpx.post(f"{smol_cluster.url}{path}", content=body,
                                  headers={"content-type": "application/json"}, timeout=60)
            else:
                resp = httpx.post(f"{smol_cluster.url}{path}", json=body, timeout=60)
            assert resp.status_code == status, (name, resp.text)
            error = resp.json()["error"]
            assert error["message"] and error["type"], name
            if code:
                assert error["code"] == code, name
        assert running.result(timeout=300) == reference
    too_long = httpx.post(f"{smol_cluster.url}/v1/completions", json=BAD_REQUESTS[-1][2], timeout=60).json()
    assert "maximum context length is 2048 tokens" in too_long["error"]["message"]


def test_greedy_tokens_equal_hf_transformers(smol_cluster: ServedCluster, embedded_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir, torch_dtype=torch.float32)
    for question in QUESTIONS[:4]:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        if not isinstance(prompt_ids, list):
            prompt_ids = list(prompt_ids["input_ids"])
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)
        expected = out[0, len(prompt_ids):].tolist()
        resp = httpx.post(f"{smol_cluster.url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt_ids, "temperature": 0, "max_tokens": 24, "return_token_ids": True})
        got = resp.json()["choices"][0]["token_ids"]
        eos = set(tok.convert_tokens_to_ids([tok.eos_token])) | {model.generation_config.eos_token_id}
        expected = expected[: next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))]
        assert got == expected, question


def test_idle_keep_alive_connection_outlives_client_pool_expiry(smol_cluster: ServedCluster) -> None:
    """The server keeps an idle connection longer than httpx's 5 s pool expiry, so a client never sends a
    request on a connection the server is closing (a connection reset under load, seen at qps 32)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", smol_cluster.port, timeout=30)
    conn.request("GET", "/health")
    first = conn.getresponse()
    first.read()
    sock = conn.sock
    time.sleep(6.0)
    conn.request("GET", "/health")  # on the same socket: the server has not closed it
    second = conn.getresponse()
    second.read()
    assert (first.status, second.status) == (200, 200)
    assert conn.sock is sock
    conn.close()
