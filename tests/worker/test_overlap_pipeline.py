"""The one-step-ahead pipeline in one process: the real scheduler Engine drives the real WorkerService over a real
CPU model runner (eager, and the CUDA-graph runner replaying on the CPU), with results applied exactly as the
three processes do it. With `max_inflight_steps = 2` step k+1 is planned and launched before step k's tokens
are collected, so decode inputs are PENDING and gathered from the previous launch's sampled tokens.

The overlapped run must give exactly the tokens of the synchronous one: greedy and seeded sampling, stop ids
(with min_tokens holding one back), max_tokens, a penalised row (which forces the earlier step to be collected
first), preemptions on a tight KV cache, and aborts while steps are in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest

from infer_core.dtypes import DType
from infer_core.ports.backend import LlmBackend
from infer_protocol.messages import SamplingParams, StepResult, Submit
from infer_scheduler.engine import Engine
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.application.worker_service import WorkerService
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.test_graph_runner import ReplayingCpuBackend
from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint

BLOCK_SIZE = 4
MAX_BLOCKS_PER_SEQ = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-overlap")
    write_checkpoint(qwen3_config(tied=True), path, seed=5)
    return path


def make_runner(model_dir: Path, graphs: bool, num_blocks: int, backend: LlmBackend | None = None) -> ModelRunner:
    backend = backend or ReplayingCpuBackend()
    model, spec = load_model(model_dir, backend, DType.FLOAT32, "auto", 0)
    caches = backend.allocate_kv_cache(spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim,
                                       DType.FLOAT32)
    if not graphs:
        return ModelRunner(model, backend, caches, BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, backend.device)
    runner = GraphModelRunner(model, backend, caches, BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, backend.device,
                              capture_sizes=[1, 2, 3, 4, 6, 8], capture_tokens=[8, 16, 32])
    runner.capture()
    return runner


def submits(stop_at: dict[str, int] | None = None) -> list[Submit]:
    """8 requests: prompts of 5..19 tokens sharing a prefix, mixed sampling and stops (`stop_at`: request id ->
    a token id it stops on)."""
    stop_at = stop_at or {}
    greedy = SamplingParams(temperature=0.0)
    subs = []
    for i in range(8):
        prompt = [3, 9, 27, 81, 50] + [(17 * i + 7 * j) % 250 + 1 for j in range(2 * i)]
        sampling = greedy
        if i == 2:
            sampling = SamplingParams(temperature=0.8, top_k=40, seed=1234)
        if i == 5:
            sampling = SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3)
        rid = f"r{i}"
        stops = [stop_at[rid]] if rid in stop_at else []
        max_tokens = 4 if i == 5 else 8 + (5 * i) % 13  # the penalised row ends early: later decodes can replay
        subs.append(Submit(request_id=rid, prompt_token_ids=prompt, sampling=sampling, max_tokens=max_tokens,
                           stop_token_ids=stops, min_tokens=3 if i == 4 else 0))
    return subs


def serve(runner: ModelRunner, subs: list[Submit], *, overlap: bool, num_blocks: int,
          abort_after: dict[str, int] | None = None, initial: int = 4,
          **limits: Any) -> tuple[dict[str, tuple[list[int], str | None]], Engine]:
    """Run the engine and the worker service to completion the way the scheduler and worker loops do.
    `initial` requests arrive at once, the others one per applied result; `abort_after`: request id -> results
    applied before its abort; `limits`: Engine arguments over this module's (max_model_len, chunk size, ...)."""
    defaults = dict(block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE * MAX_BLOCKS_PER_SEQ, max_batch_tokens=24,
                    chunked_prefill_size=8, max_inflight_steps=2 if overlap else 1, vocab_size=256)
    engine = Engine(num_blocks=num_blocks, **(defaults | limits))
    service = WorkerService(runner, grammars=runner.grammars)  # (a runner given a GrammarBook serves grammars)
    out: dict[str, tuple[list[int], str | None]] = {s.request_id: ([], None) for s in subs}
    late = deque(subs[initial:])
    for s in subs[:initial]:
        assert engine.submit(s) is None
    held: deque[StepResult] = deque()
    applied = 0
    while True:
        while engine.can_plan and (plan := engine.plan_step()) is not None:
            held.extend(service.launch(plan))
            while service.num_inflight > 1:  # the worker loop: step k+1 queued, now collect step k
                held.append(service.collect())
        if not held and service.num_inflight:
            held.append(service.collect())
        if not held and engine.has_work and service.compiling:
            # Only requests held for their grammars: the worker loop polls the compilations and reports them unasked.
            while (status := service.grammar_status()) is None:
                time.sleep(0.002)
            engine.grammars_ready(status.ready)
            engine.fail_sequences(status.errors)
            continue
        if not held:
            assert not engine.has_work and not late
            return out, engine
        result = held.popleft()
        engine.fail_sequences(result.seq_errors)  # (as the scheduler's service: a grammar that failed ends alone)
        for o in engine.apply_result(result):
            toks, _ = out[o.request_id]
            out[o.request_id] = (toks + o.token_ids, o.finish_reason)
        applied += 1
        engine.check_invariants()
        if late:
            assert engine.submit(late.popleft()) is None
        for rid, when in (abort_after or {}).items():
            if applied == when and rid in engine.requests:
                o = engine.abort(rid)
                assert o is not None
                out[rid] = (out[rid][0], o.finish_reason)
        assert applied < 2000


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
def test_overlapped_pipeline_gives_the_synchronous_tokens(model_dir: Path, graphs: bool) -> None:
    check_overlap_equals_sync(model_dir, graphs, ReplayingCpuBackend)


def test_graph_runner_gives_the_eager_tokens_with_a_penalised_row(model_dir: Path) -> None:
    """r5's penalties keep decode batches off the decode graphs; they replay mixed graphs (which stop at the
    logits) and the logits processing runs after: the tokens are the eager runner's."""
    subs = submits()
    eager, _ = serve(make_runner(model_dir, False, 64), subs, overlap=True, num_blocks=64)
    runner = make_runner(model_dir, True, 64)
    graphed, _ = serve(runner, subs, overlap=True, num_blocks=64)
    assert graphed == eager
    assert isinstance(runner, GraphModelRunner) and runner.mixed_graph_steps > 0
    assert runner.eager_steps == 0


def check_overlap_equals_sync(model_dir: Path, graphs: bool, make_backend: Callable[[], LlmBackend]) -> None:
    ample = 256
    runner = make_runner(model_dir, graphs, ample, make_backend())
    free_run, _ = serve(runner, submits(), overlap=False, num_blocks=ample)
    # Stop ids taken from the free run: r1 and r4 stop on their 3rd token (r4's min_tokens=3 holds it back, so it
    # stops at a later occurrence or runs to max_tokens), r6 on its 6th.
    stop_at = {rid: free_run[rid][0][k] for rid, k in (("r1", 2), ("r4", 2), ("r6", 5))}
    subs = submits(stop_at)

    sync, _ = serve(runner, subs, overlap=False, num_blocks=ample)
    overlapped, _ = serve(runner, subs, overlap=True, num_blocks=ample)
    assert overlapped == sync
    assert sync["r1"][1] == "stop" and sync["r1"][0][-1] == stop_at["r1"] and len(sync["r1"][0]) <= 3
    assert sync["r6"][1] == "stop" and len(sync["r6"][0]) <= 6
    assert all(len(toks) >= 3 for toks, _ in [sync["r4"]])
    assert sync["r0"] == (free_run["r0"][0], "length") and len(sync["r0"][0]) == 8
    if graphs:
        assert isinstance(runner, GraphModelRunner) and runner.graph_steps > 0 and runner.mixed_graph_steps > 0

    # A KV cache of 20 blocks (80 tokens) for 8 requests of up to 40: preemption under both pipelines.
    tight_runner = make_runner(model_dir, graphs, 20, make_backend())
    tight_sync, e_sync = serve(tight_runner, subs, overlap=False, num_blocks=20)
    tight_overlapped, e_overlap = serve(tight_runner, subs, overlap=True, num_blocks=20)
    assert e_sync.counters.preemptions > 0 and e_overlap.counters.preemptions > 0
    assert tight_sync == sync and tight_overlapped == sync
    for e in (e_sync, e_overlap):
        assert e.kv.num_free + e.kv.num_cached == e.kv.num_blocks


def test_aborts_while_steps_are_in_flight_change_no_other_request(model_dir: Path) -> None:
    runner = make_runner(model_dir, False, 64)
    subs = submits()
    ref, _ = serve(runner, subs, overlap=False, num_blocks=64)
    aborts = {"r0": 3, "r3": 6, "r7": 9}
    got, engine = serve(runner, subs, overlap=True, num_blocks=64, abort_after=aborts)
    for rid, (toks, reason) in got.items():
        if rid in aborts:
            assert reason == "abort" and toks == ref[rid][0][:len(toks)], rid
            assert len(toks) < len(ref[rid][0]), rid
        else:
            assert (toks, reason) == ref[rid], rid
    assert engine.kv.num_free + engine.kv.num_cached == engine.kv.num_blocks


def test_a_row_that_reads_its_output_stalls_no_other_row(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """r5's penalties read its own tokens: the scheduler plans it only once its last token is back, so the worker
    never has to collect a step in flight before launching the next (the pipeline keeps every other row going),
    and the tokens are the synchronous run's."""
    subs = submits()
    early: list[int] = []
    launch = WorkerService.launch

    def counting(self: WorkerService, plan: Any) -> list:
        results = launch(self, plan)
        early.append(len(results))
        return results

    sync, _ = serve(make_runner(model_dir, False, 64), subs, overlap=False, num_blocks=64)
    monkeypatch.setattr(WorkerService, "launch", counting)
    piped, _ = serve(make_runner(model_dir, False, 64), subs, overlap=True, num_blocks=64)
    assert piped == sync
    assert len(early) > 20 and sum(early) == 0
