"""Tensor parallelism end to end on the CPU backend (gloo): three real processes per cluster, the worker running
N ranks. Greedy and seeded-sampling tokens at TP = 2, 3, 4 are exactly those of TP = 1 on the same tiny random
checkpoint (Llama with GQA; Qwen3 with q/k norms and tied embeddings, split over a sharded safetensors index),
and a rank that dies or hangs mid-stream ends the requests with an error within the deadline, after which the
supervisor restarts the whole group.

| model | heads / kv heads | intermediate | files           | TP          |
|-------|------------------|--------------|-----------------|-------------|
| llama | 24 / 12          | 192          | one             | 1, 2, 3, 4  |
| qwen3 | 8 / 4 (tied)     | 128          | 3, with index   | 1, 2, 4     |
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.e2e.test_faults import LONG, MODEL, assert_error_then_done, ended_at, start_call, wait_for
from tests.e2e.tp_models import VOCAB, Shape, write_checkpoint

MODELS = {
    "llama": (Shape("LlamaForCausalLM", heads=24, kv_heads=12, head_dim=8, intermediate=192), 1),
    "qwen3": (Shape("Qwen3ForCausalLM", heads=8, kv_heads=4, head_dim=16, intermediate=128, tied=True), 3),
}
DEGREES = {"llama": (1, 2, 3, 4), "qwen3": (1, 2, 4)}
MAX_TOKENS = 16
OP_TIMEOUT = 4.0  # tp_operation_timeout_secs of the fail-stop cluster: a hung rank stops the group this fast


def _prompts() -> list[list[int]]:
    """Four prompts, 5..37 tokens: with block_size 4 and chunked prefill of 16 they span blocks and chunks."""
    rng = random.Random(18)
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in (5, 13, 22, 37)]


PROMPTS = _prompts()
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {name: write_checkpoint(root / name, embedded_model_dir, shape, seed=7 + i, files=files)
            for i, (name, (shape, files)) in enumerate(MODELS.items())}


def _cluster(workdir: Path, model_dir: Path, tp: int, **fields: Any) -> ServedCluster:
    return ServedCluster(workdir, model=str(model_dir), model_name=MODEL, tensor_parallel_size=tp, num_blocks=256,
                         block_size=4, max_model_len=512, chunked_prefill_size=16, max_batch_tokens=48,
                         idle_prefill_uses_step_budget=False, **fields)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]
             ) -> Iterator[dict[tuple[str, int], ServedCluster]]:
    made = {(name, tp): _cluster(tmp_path_factory.mktemp(f"tp-{name}-{tp}"), model_dirs[name], tp)
            for name, degrees in DEGREES.items() for tp in degrees}
    try:
        with cf.ThreadPoolExecutor(4) as pool:  # start-up is mostly imports: overlap some of them
            for fut in [pool.submit(c.start, 300) for c in made.values()]:
                fut.result()
        yield made
    finally:
        for c in made.values():  # those a test has not stopped already
            c.stop()


def _generate(cluster: ServedCluster, prompt: list[int], **sampling: Any) -> list[int]:
    resp = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
        "temperature": 0} | sampling)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == MAX_TOKENS, choice
    return choice["token_ids"]


Tokens = tuple[list[list[int]], list[list[int]]]  # (greedy, seeded-sampled), in prompt order


def _all(cluster: ServedCluster) -> Tokens:
    """Every prompt greedy and seeded-sampled, all at once, so the ranks run batched, chunked and decode steps with
    greedy and sampling rows together."""
    jobs = [(p, {}) for p in PROMPTS] + [(p, SAMPLED) for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        tokens = list(pool.map(lambda job: _generate(cluster, job[0], **job[1]), jobs))
    return tokens[:len(PROMPTS)], tokens[len(PROMPTS):]


CASES = [(name, tp) for name, degrees in DEGREES.items() for tp in degrees if tp > 1]


@pytest.fixture(scope="module")
def reference(clusters: dict[tuple[str, int], ServedCluster]) -> dict[str, Tokens]:
    """Each model's tokens at TP = 1; those clusters are stopped then (an idle cluster costs CPU time)."""
    tokens = {name: _all(clusters[name, 1]) for name in DEGREES}
    for name in DEGREES:
        assert clusters[name, 1].stop() == 0
    return tokens


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_greedy_and_seeded_tokens_are_those_of_one_rank(
        clusters: dict[tuple[str, int], ServedCluster], reference: dict[str, Tokens], name: str, tp: int) -> None:
    greedy, sampled = reference[name]
    assert len({tuple(t) for t in greedy}) == len(PROMPTS)  # four different continuations: a real comparison
    assert sampled != greedy  # sampling, not greedy decoding in disguise
    assert _all(clusters[name, tp]) == (greedy, sampled)
    # A clean stop: rank 0 broadcasts Shutdown, every rank leaves the group, the worker (and serve) exit 0.
    assert clusters[name, tp].stop() == 0, clusters[name, tp].log()


# ------------------------------------------------------------------ fail-stop


def _ranks(worker_pid: int) -> list[int]:
    """Ranks 1..N-1: the worker's children (rank 0 spawned them)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def _greedy(cluster: ServedCluster) -> list[int]:
    return _generate(cluster, PROMPTS[1])


def _stream_until(cluster: ServedCluster, act: Any) -> Any:
    """A long stream; `act` runs on its own thread at its first token (mid-stream, however fast the machine)."""
    acted: list[float] = []
    call = start_call(cluster.url, "/v1/completions", LONG | {"max_tokens": 400}, stream=True,
                      on_first_token=lambda: acted.append(act()))
    assert call.first_token.wait(90) and acted, f"no token streamed: {call.status} {call.error!r}"
    call.join(timeout=60)
    return call, acted[0]


def test_a_dead_or_hung_rank_stops_the_group_and_the_supervisor_restarts_it(
        tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    """A killed rank 1: the stream ends at once and the supervisor restarts the group, which serves the same
    tokens. Then a stopped (hung) rank 1: the stream ends after the operation timeout, and with the one restart
    allowed spent the launcher stops the cluster, naming the worker."""
    cluster = _cluster(tmp_path, model_dirs["llama"], 2, tp_operation_timeout_secs=OP_TIMEOUT,
                       worker_timeout_secs=60.0, worker_restart_backoff_secs=0.5, worker_max_restarts=1)
    cluster.start(timeout=300)
    try:
        before = _greedy(cluster)

        def kill_rank_1() -> float:
            (rank_1,) = _ranks(cluster.pids()["worker"])
            os.kill(rank_1, signal.SIGKILL)
            return time.monotonic()

        worker = cluster.pids()["worker"]
        call, killed_at = _stream_until(cluster, kill_rank_1)
        assert_error_then_done(call, "worker_lost")
        assert ended_at(call) - killed_at < 2.0  # rank 0's watchdog: no operation timeout to wait out
        wait_for("the restarted group serving", lambda: httpx.get(f"{cluster.url}/ready", timeout=5).status_code
                 == 200 and cluster.pids().get("worker") not in (None, worker), 180, 0.2)
        assert _greedy(cluster) == before

        frozen: list[int] = []

        def stop_rank_1() -> float:  # hung, not dead: only the operation timeout can tell
            (rank_1,) = _ranks(cluster.pids()["worker"])
            os.kill(rank_1, signal.SIGSTOP)
            frozen.append(rank_1)
            return time.monotonic()

        call, stopped_at = _stream_until(cluster, stop_rank_1)
        assert_error_then_done(call, "worker_lost")
        assert OP_TIMEOUT - 0.5 < ended_at(call) - stopped_at < OP_TIMEOUT + 3.0  # the timeout, and no more
        wait_for("the stopped rank killed with its group", lambda: not Path(f"/proc/{frozen[0]}").exists(), 10, 0.1)
        assert cluster.proc is not None
        cluster.proc.wait(timeout=60)  # the restart budget is spent: serve stops
        log = cluster.log()
        assert "failed with a fatal error" in log and "Timed out" in log, log
    finally:
        cluster.stop()
