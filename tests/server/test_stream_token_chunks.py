"""One streamed chunk a generated token, as vLLM streams, and the benches that time a stream (serve_sweep,
long_prompts, offline_throughput's timeline) counting them as vLLM's benchmark does: a token whose text is held back
(the answer's emoji spans several byte tokens) still arrives as a chunk of its own, so the inter-token latency sees
one gap a token, not a double gap where a character completes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from infer_server.tokenizer import Tokenizer
from tests.bench.scripts import load_bench_script
from tests.server.conftest import ANSWER, ServerHarness
from tests.server.fake_scheduler import FAKE_PREFILL_TIME, FAKE_QUEUE_TIME

serve_sweep = load_bench_script("serve_sweep")


async def _one(url: str, prompt_ids: list[int] | None) -> object:
    async with httpx.AsyncClient(timeout=10) as client:
        return await serve_sweep.one_request(client, url, "tiny-chat", [{"role": "user", "content": "Hi"}], 32,
                                             extra={}, prompt_ids=prompt_ids)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_sweep_client_counts_a_chunk_a_token(server: ServerHarness, tokenizer: Tokenizer, endpoint: str) -> None:
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    held = [k for k in range(1, len(answer_ids) + 1) if tokenizer.decode(answer_ids[:k]).endswith("\ufffd")]
    assert held  # the answer has tokens whose text waits for the next one
    rec = asyncio.run(_one(server.url, None if endpoint == "chat" else tokenizer.encode("q")))
    assert rec.ok and rec.text == ANSWER and rec.finish_reason == "stop"
    assert rec.output_tokens == len(answer_ids) + 1  # the EOS counted, not shown
    assert len(rec.itl) == len(answer_ids) - 1  # the first token is the TTFT; every later one a gap
    assert rec.ttft > 0 and all(gap >= 0 for gap in rec.itl)


def test_long_prompts_ttft_is_the_first_token_chunk(server: ServerHarness, tokenizer: Tokenizer) -> None:
    long_prompts = load_bench_script("long_prompts")
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    with httpx.Client(timeout=10) as client:
        ttft, tokens, error = long_prompts.stream_completion(client, server.url, {"model": "tiny-chat", "prompt": "q"})
    assert error == "" and ttft > 0 and tokens == len(answer_ids) + 1


def test_offline_bench_timeline_counts_token_chunks(server: ServerHarness, tokenizer: Tokenizer) -> None:
    offline = load_bench_script("offline_throughput")
    jobs = offline.make_jobs(3, 0, 0, tokenizer.vocab_size, 0, 4, 64)  # ignore_eos: 64 tokens each
    plain = asyncio.run(offline.run(server.url, "tiny-chat", jobs))
    streamed = asyncio.run(offline.run(server.url, "tiny-chat", jobs, timeline=True))
    for result in (plain, streamed):
        assert result["num_seqs"] == 3 and result["output_tokens"] == 3 * 64
        assert result["late_start_s"] < 1.0 and result["wall_s"] > 0
    timeline = streamed["timeline"]
    assert 0 < timeline["first_token_s"]["min"] <= timeline["first_token_s"]["max"] <= timeline["last_token_s"]
    assert timeline["last_token_s"] <= streamed["wall_s"] and timeline["decode_gap_ms"]["p50"] > 0


def test_sweep_level_timeline_holds_every_gap_and_classes_the_long_ones(server: ServerHarness,
                                                                        tokenizer: Tokenizer) -> None:
    import time

    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    before = time.time()
    short = serve_sweep.Workload("long", 60)  # ~60 characters: within the fake engine's 128-token context
    level = asyncio.run(serve_sweep.run_level(server.url, "tiny-chat", 20.0, 0.3, 32, seed=1, extra={},
                                              workload=short, timeline=True))
    timeline = level["timeline"]
    assert level["failed"] == 0, level["errors"]
    assert len(timeline) == level["num_requests"] >= 1
    for t in timeline:
        assert before <= t["sent"] <= time.time() and t["ttft"] > 0
        assert len(t["itl"]) == len(answer_ids) - 1
    report = level["long_gaps"]
    assert report["gaps"] == sum(len(t["itl"]) for t in timeline)
    # the server's phases over the level: the fake scheduler's timings on every request's first output
    phases = level["server_phases_ms"]
    assert phases["queue"] == 1e3 * FAKE_QUEUE_TIME and phases["prefill"] == 1e3 * FAKE_PREFILL_TIME
    assert phases["hops"] == pytest.approx(phases["ttft"] - phases["queue"] - phases["prefill"])
    assert phases["ttft"] > 0 and phases["decode"] > 0
    assert report["long"] == report["beside_prefill"] + report["shared"] + report["alone"]


def test_sweep_arrivals_are_poisson_from_the_level_start(server: ServerHarness) -> None:
    """The first arrival comes after an exponential gap, as every later one: it came at the level's start in every
    client process, so the four processes of a sweep sent a burst of four, whose TTFTs (with each process's own
    first-request set-up) were the level's p99 at qps 1 and 8 (the twenty-first session's timelines)."""
    import random
    import time

    first_gap = random.Random(2).expovariate(20.0)  # 0.156 s: the first draw of the level's generator
    start_at = time.time() + 1.5  # the client opens its connection before it: a head start on a loaded machine
    records, _ = asyncio.run(serve_sweep.drive(server.url, "tiny-chat", 20.0, 0.3, 32, seed=2, start_at=start_at,
                                               extra={}, workload=serve_sweep.Workload("long", 60)))
    assert records and all(r.ok for r in records)
    assert first_gap - 0.005 <= min(r.sent for r in records) - start_at < first_gap + 0.3
