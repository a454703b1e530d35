"""Scheduler depth end to end: three real processes per cluster (server, scheduler, worker) on the CPU backend,
greedy, `return_token_ids`, on a tiny random Llama checkpoint the module writes itself (numpy + safetensors, no
torch or transformers in the test process) with the embedded model's real tokenizer.

Five clusters, started at once and shared by the tests (module scope); `ref` is the unconstrained reference:

| cluster | prefix caching | chunked prefill                         | KV cache                          |
|---------|----------------|-----------------------------------------|-----------------------------------|
| `ref`   | off            | off (chunk 2048, 8192 tokens a step)    | ample, block_size 16              |
| `chunk` | off            | chunk 8, 24 tokens a step               | ample, block_size 16              |
| `both`  | on             | chunk 8, 24 tokens a step               | ample, block_size 4               |
| `tight` | on             | off                                     | 40 blocks of 4 = 160 tokens       |
| `sync`  | on             | off                                     | as `tight`, synchronous pipeline  |

Every cluster but `sync` runs the one-step-ahead pipeline (`enable_overlap`, the default), each plan held until
shortly before the worker needs it (`plan_slack_ms`, the default) but in `ref`, which sends it as a step starts.

Exact token lists are compared across clusters (a cache hit, a chunk boundary or a preemption that changes a
single token fails the test), and the scheduler's Prometheus counters are read back with exact deltas.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import HEARTBEAT_SECS, Frozen, ServedCluster

MODEL = "tiny"
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

CHUNK = 8  # chunked_prefill_size of `chunk` and `both`
STEP_TOKENS = 24  # max_batch_tokens of `chunk` and `both`
TIGHT_BLOCKS, TIGHT_BLOCK_SIZE = 40, 4  # `tight`: 160 tokens of KV cache in all
BOTH_BLOCK_SIZE = 4

# ------------------------------------------------------------------ prompts


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _prompts() -> list[list[int]]:
    """16 prompts (55..67 tokens): one 40-token system prefix, four 12-token group prefixes, unique tails."""
    rng = random.Random(20240611)
    system = _ids(rng, 40)
    groups = [_ids(rng, 12) for _ in range(4)]
    return [system + groups[i % 4] + _ids(rng, 3 + (5 * i) % 13) for i in range(16)]


PROMPTS = _prompts()
MAX_TOKENS = 20


# ------------------------------------------------------------------ checkpoint


def _write_checkpoint(path: Path, tokenizer_dir: Path) -> None:
    """A 2-layer Llama (hidden 64) with N(0, 0.5) weights: logits spread widely, so greedy picks are not near-ties."""
    import numpy as np
    from safetensors.numpy import save_file

    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    rng = np.random.default_rng(1234)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, size=shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, hidden), "lm_head.weight": normal(VOCAB, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)


# ------------------------------------------------------------------ clusters

CLUSTERS: dict[str, dict[str, object]] = {
    "ref": dict(enable_prefix_caching=False, block_size=16, plan_slack_ms=0.0),
    "chunk": dict(enable_prefix_caching=False, block_size=16, chunked_prefill_size=CHUNK,
                  max_batch_tokens=STEP_TOKENS),
    # `chunk` lets a lone prompt take the whole step budget (the default); `both` keeps its chunks of 8 alone too
    "both": dict(enable_prefix_caching=True, block_size=BOTH_BLOCK_SIZE, chunked_prefill_size=CHUNK,
                 max_batch_tokens=STEP_TOKENS, idle_prefill_uses_step_budget=False),
    # worker_timeout_secs: the refusal test stops this worker (SIGSTOP) for a moment; it must not be taken for lost
    "tight": dict(enable_prefix_caching=True, block_size=TIGHT_BLOCK_SIZE, num_blocks=TIGHT_BLOCKS,
                  worker_timeout_secs=60.0),
    "sync": dict(enable_prefix_caching=True, block_size=TIGHT_BLOCK_SIZE, num_blocks=TIGHT_BLOCKS,
                 enable_overlap=False),
}


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[dict[str, ServedCluster]]:
    model_dir = tmp_path_factory.mktemp("sched-depth") / "tiny-llama"
    _write_checkpoint(model_dir, embedded_model_dir)
    made = {name: ServedCluster(tmp_path_factory.mktemp(f"sched-{name}"), model=str(model_dir), model_name=MODEL,
                                **fields)
            for name, fields in CLUSTERS.items()}
    try:
        with cf.ThreadPoolExecutor(len(made)) as pool:  # start-up is mostly imports: overlap them
            for fut in [pool.submit(c.start) for c in made.values()]:
                fut.result()
        yield made
    finally:
        for c in made.values():
            c.stop()


@pytest.fixture(scope="module")
def reference(clusters: dict[str, ServedCluster]) -> list[list[int]]:
    """The unconstrained run: every prompt's greedy tokens on `ref`, sent concurrently."""
    return complete_all(clusters["ref"], PROMPTS)


# ------------------------------------------------------------------ helpers


def complete(cluster: ServedCluster, prompt: list[int], max_tokens: int = MAX_TOKENS,
             timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
        "return_token_ids": True})


def tokens_of(resp: httpx.Response, max_tokens: int = MAX_TOKENS) -> list[int]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert len(choice["token_ids"]) == max_tokens, choice
    return choice["token_ids"]


def wait_for_inflight(cluster: ServedCluster, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while metrics(cluster)["rustinfer_num_requests_inflight"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests in flight after {timeout} s"
        time.sleep(0.01)


def complete_all(cluster: ServedCluster, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Send every prompt at once (one thread each) and return the generated ids in prompt order."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        resps = list(pool.map(lambda p: complete(cluster, p, max_tokens), prompts))
    return [tokens_of(r, max_tokens) for r in resps]


_SAMPLE = re.compile(r"^(rustinfer_[a-z_]+) ([-+0-9.eE]+|NaN|\+Inf)$", re.M)


def metrics(cluster: ServedCluster) -> dict[str, float]:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


def settled(cluster: ServedCluster, before: dict[str, float] | None = None, timeout: float = 20.0) -> dict[str, float]:
    """The scheduler's figures once it is idle and has reported so after the work just done (call it once every
    response of that work has arrived).

    /metrics shows the scheduler's latest Pong (one per heartbeat). A Pong with nothing running or waiting and
    more steps than `before` may still be one from an idle moment in the middle of the work (concurrent requests
    that did not all overlap), so the figures count only once a reading several heartbeats later shows the same
    step count: by then the latest Pong was sent after the last request finished."""
    deadline = time.monotonic() + timeout
    candidate: dict[str, float] | None = None
    while True:
        m = metrics(cluster)
        idle = m["rustinfer_num_requests_running"] == 0 and m["rustinfer_num_requests_waiting"] == 0
        moved = before is None or m["rustinfer_scheduler_steps_total"] > before["rustinfer_scheduler_steps_total"]
        if idle and moved:
            if candidate is not None and candidate["rustinfer_scheduler_steps_total"] == m[
                    "rustinfer_scheduler_steps_total"]:
                return m
            candidate = m
            time.sleep(3 * HEARTBEAT_SECS)
            continue
        candidate = None
        if time.monotonic() > deadline:
            raise AssertionError(f"scheduler not idle after {timeout} s: {m}")
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after[name] - before[name])


def check_no_leak(m: dict[str, float]) -> None:
    """Idle: no block is held by a request; every block is free or cached."""
    assert m["rustinfer_kv_cache_usage_ratio"] == 0.0, m
    assert m["rustinfer_kv_cache_free_blocks"] + m["rustinfer_kv_cache_cached_blocks"] == \
        m["rustinfer_kv_cache_total_blocks"], m


# ------------------------------------------------------------------ 1. caching and chunking change no token


@pytest.mark.parametrize("name", ["chunk", "both"])
def test_outputs_identical_with_prefix_caching_and_chunked_prefill(
        name: str, clusters: dict[str, ServedCluster], reference: list[list[int]]) -> None:
    """8 prompts sharing long prefixes, sent concurrently twice (the second round finds the first's pages
    cached): the same tokens as `ref` (caching off, chunking off) with chunking alone (`chunk`) and with both
    (`both`); `tight` covers caching without chunking (test 2)."""
    cluster, prompts = clusters[name], PROMPTS[:8]
    before = settled(cluster)
    for _ in range(2):
        assert complete_all(cluster, prompts) == reference[:8]
    after = settled(cluster, before)
    check_no_leak(after)

    queries = delta(after, before, "rustinfer_prefix_cache_queries_tokens_total")
    hits = delta(after, before, "rustinfer_prefix_cache_hits_tokens_total")
    assert queries == 2 * sum(map(len, prompts))  # one lookup per admission, nobody preempted
    assert delta(after, before, "rustinfer_num_preemptions_total") == 0
    if name == "both":
        # Round two alone can hit every prompt's page-aligned tokens but its last (pages of 4).
        assert hits >= sum((len(p) - 1) // BOTH_BLOCK_SIZE * BOTH_BLOCK_SIZE for p in prompts)
        assert hits < queries
    else:
        assert hits == 0
    # Chunked prefill really split the prompts: no step computed more than STEP_TOKENS tokens, so the prompts
    # and decodes of both rounds took at least this many steps (the reference does one round in ~MAX_TOKENS).
    computed = 2 * (sum(map(len, prompts)) + len(prompts) * (MAX_TOKENS - 1)) - hits
    steps = delta(after, before, "rustinfer_scheduler_steps_total")
    assert steps * STEP_TOKENS >= computed, (steps, computed)

    # Alone, a fresh 50-token prompt is prefilled in ceil(50 / 8) = 7 chunks on `both`, in ceil(50 / 24) = 3 on
    # `chunk`, where with nothing decoding a chunk takes the whole step budget (the last samples the first
    # token), then decodes one token a step.
    lone = _ids(random.Random(name), 50)
    out = tokens_of(complete(cluster, lone, 5), 5)
    assert out == tokens_of(complete(clusters["ref"], lone, 5), 5)
    after_lone = settled(cluster, after)
    prefill_steps = -(-50 // (CHUNK if name == "both" else STEP_TOKENS))
    assert delta(after_lone, after, "rustinfer_scheduler_steps_total") == prefill_steps + 4
    assert delta(after_lone, after, "rustinfer_prefix_cache_hits_tokens_total") == 0


# ------------------------------------------------------------------ 2 + 4. preemption, and refusal under load


def test_preemption_under_a_tiny_kv_cache_and_refusal_of_never_fitting_requests(
        clusters: dict[str, ServedCluster], reference: list[list[int]]) -> None:
    """16 concurrent requests on a 160-token KV cache (each alone needs up to 86 tokens): preemption must
    happen, and every request finishes with the reference's tokens. Meanwhile requests that could never fit
    the whole cache are refused at once with a 400: the worker lowered the automatic max_model_len (the model's
    512) to the 160 tokens the cache holds, so the server refuses them against that context length."""
    cluster = clusters["tight"]
    before = settled(cluster)
    assert before["rustinfer_kv_cache_total_blocks"] == TIGHT_BLOCKS
    cap = TIGHT_BLOCKS * TIGHT_BLOCK_SIZE
    never_fit = [
        (PROMPTS[0][:30], 200),  # 30 + 200 tokens > 160: the completion can never fit
        ((PROMPTS[1] * 3)[:cap + 10], 1),  # the prompt alone is beyond the cache
    ]

    finished = threading.Event()
    results: list[list[int]] = []

    def run_all() -> None:
        results.extend(complete_all(cluster, PROMPTS))
        finished.set()

    # The worker is stopped while the 16 arrive and the refusals are sent: none of the 16 can finish before the
    # refusals come back, however fast the machine, so a refusal that waited for the cache to drain would hang.
    worker = cluster.freeze()
    runner = threading.Thread(target=run_all)
    runner.start()
    try:
        # The server's own in-flight gauge is live (the scheduler's figures lag by up to a heartbeat).
        wait_for_inflight(cluster, 4, timeout=60)
        for prompt, max_tokens in never_fit:
            try:  # refused at submission, not queued until the others are done (or forever)
                resp = complete(cluster, prompt, max_tokens, timeout=10)
            except httpx.TimeoutException:
                pytest.fail(f"a request needing {len(prompt) + max_tokens} tokens of a {cap}-token cache was "
                            "not refused within 10 s")
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["code"] == "context_length_exceeded", err
            assert err["type"] == "invalid_request_error", err
            assert f"maximum context length is {cap} tokens" in err["message"], err
        assert not finished.is_set()
    finally:
        worker.resume()
        runner.join(timeout=300)
    assert finished.is_set()
    assert results == reference

    after = settled(cluster, before)
    check_no_leak(after)
    assert delta(after, before, "rustinfer_num_preemptions_total") > 0
    # Every admission (first ones and re-admissions after preemption) looks up the cache.
    assert delta(after, before, "rustinfer_prefix_cache_queries_tokens_total") > sum(map(len, PROMPTS))
    # A refused request left no trace, and the cluster still serves.
    assert tokens_of(complete(cluster, PROMPTS[5])) == reference[5]


# ------------------------------------------------------------------ 3. a shared prefix is served from the cache


def test_shared_prefix_of_a_finished_request_is_served_from_the_cache(
        clusters: dict[str, ServedCluster]) -> None:
    """On `both` (pages of 4, prefill chunks of 8): one request at a time, each measured alone.

    The prefill work of a request is visible in the step counter: alone, it takes ceil(uncached / 8) prefill
    steps (the last one samples the first token) and then max_tokens - 1 decode steps."""
    cluster, ref = clusters["both"], clusters["ref"]
    bs, max_tokens = BOTH_BLOCK_SIZE, 4
    rng = random.Random(7)
    shared = [rng.randrange(100, 200)] + _ids(rng, 65)  # 66 tokens; no other prompt starts in [100, 200)
    a = shared + [7001, 7002, 7003, 7004, 7005]  # 71 tokens
    b = shared + [8001, 8002, 8003, 8004, 8005, 8006, 8007]  # 73 tokens: diverges from `a` at token 66

    def run(prompt: list[int]) -> tuple[list[int], dict[str, int]]:
        before = settled(cluster)
        out = tokens_of(complete(cluster, prompt, max_tokens), max_tokens)
        after = settled(cluster, before)
        check_no_leak(after)
        assert out == tokens_of(complete(ref, prompt, max_tokens), max_tokens)  # a hit changes no token
        names = {"queries": "rustinfer_prefix_cache_queries_tokens_total",
                 "hits": "rustinfer_prefix_cache_hits_tokens_total", "steps": "rustinfer_scheduler_steps_total"}
        return out, {k: delta(after, before, v) for k, v in names.items()}

    def steps_for(uncached: int) -> int:
        return -(-uncached // CHUNK) + max_tokens - 1

    # A: nothing cached, the whole prompt is prefilled (9 chunks of 8).
    out_a, d = run(a)
    assert d == {"queries": 71, "hits": 0, "steps": steps_for(71)}

    # B shares 66 tokens with the finished A: the page-aligned 64 come from the cache, 9 tokens are computed.
    shared_aligned = len(shared) // bs * bs
    assert shared_aligned == 64
    _, d = run(b)
    assert d == {"queries": 73, "hits": shared_aligned, "steps": steps_for(73 - shared_aligned)}
    assert d["steps"] == 2 + max_tokens - 1

    # A again: a full-prompt hit still computes its last page (its logits sample the first token).
    out_a2, d = run(a)
    assert out_a2 == out_a
    assert d == {"queries": 71, "hits": 68, "steps": steps_for(3)}

    # A follow-up turn: A's prompt + A's answer + more. A's pages were cached when it finished, generated tokens
    # included (74 computed tokens -> 18 pages = 72 tokens: the prompt and the first generated token).
    c = a + out_a + [9001, 9002, 9003, 9004, 9005, 9006]  # 81 tokens
    _, d = run(c)
    assert d == {"queries": 81, "hits": 72, "steps": steps_for(81 - 72)}


# ------------------------------------------------------------------ KV usage while a request runs


def test_kv_usage_counts_the_cached_pages_a_running_request_holds(clusters: dict[str, ServedCluster]) -> None:
    """While a request decodes on `both`, its prompt pages are in the radix cache *and* in its block table:
    they are in use (not evictable), so rustinfer_kv_cache_usage_ratio must count them.

    The request streams, and its own stream thread stops the worker (SIGSTOP) at the third token: the request is
    then decoding and stays so while the scheduler's figures (one Pong a heartbeat) catch up, however fast the
    machine decodes the other 157 tokens."""
    cluster, bs = clusters["both"], BOTH_BLOCK_SIZE
    prompt, max_tokens = _ids(random.Random(11), 60), 160
    before = settled(cluster)
    prefill_steps = -(-len(prompt) // CHUNK)
    frozen: list[Frozen] = []
    texts: list[str] = []
    third_token = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=300) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:])["choices"]
                    texts.extend(c["text"] for c in choices)
                    if len(texts) == 3 and not frozen:
                        frozen.append(cluster.freeze())
                        third_token.set()
        finally:
            third_token.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        assert third_token.wait(120) and frozen, "the stream never reached its third token"
        deadline = time.monotonic() + 20  # well inside worker_timeout_secs
        while True:
            seen = metrics(cluster)
            if seen["rustinfer_num_requests_running"] == 1 and \
                    delta(seen, before, "rustinfer_scheduler_steps_total") > prefill_steps:
                break  # decoding: the whole prompt is computed and cached
            assert time.monotonic() < deadline, f"the scheduler never reported the request decoding: {seen}"
            time.sleep(0.02)
    finally:
        for f in frozen:
            f.resume()
        streamer.join(timeout=300)
    assert not streamer.is_alive()
    total = seen["rustinfer_kv_cache_total_blocks"]
    used = total - seen["rustinfer_kv_cache_free_blocks"] - seen["rustinfer_kv_cache_cached_blocks"]
    assert len(prompt) // bs <= used <= -(-(len(prompt) + max_tokens) // bs), seen
    assert seen["rustinfer_kv_cache_usage_ratio"] == pytest.approx(used / total), seen
    ref = complete(clusters["ref"], prompt, max_tokens)
    tokens_of(ref, max_tokens)
    assert "".join(texts) == ref.json()["choices"][0]["text"]
    check_no_leak(settled(cluster, before))


# ------------------------------------------------------------------ 5. the synchronous pipeline, for comparison


def test_synchronous_pipeline_gives_the_overlapped_tokens(clusters: dict[str, ServedCluster],
                                                          reference: list[list[int]]) -> None:
    """`sync` (enable_overlap = false) serves the preemption workload of `tight` with the same tokens as the
    overlapped clusters; both preempt, and both end with every block free or cached."""
    results: dict[str, list[list[int]]] = {}
    for name in ("sync", "tight"):
        before = settled(clusters[name])
        results[name] = complete_all(clusters[name], PROMPTS)
        after = settled(clusters[name], before)
        check_no_leak(after)
        assert delta(after, before, "rustinfer_num_preemptions_total") > 0, name
    assert results["sync"] == reference and results["tight"] == reference
