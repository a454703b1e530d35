"""The scheduler service over real ZMQ IPC sockets, with a stand-in worker thread and DEALERs as servers."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import tempfile
import threading
import time

import msgspec
import pytest

from infer_protocol.config import Config
from infer_protocol.messages import Abort, Pong, RequestError, TokenBatch
from infer_scheduler.service import Service

from .conftest import make_submit
from .sim_worker import BAD_GRAMMAR
from .standin import FakeServer, StandInWorker
from .test_grammar_hold import grammar_submit

_cluster = itertools.count()


@pytest.fixture
def config():
    d = tempfile.mkdtemp(prefix="ri-sched-")  # short: unix socket paths are limited to ~100 bytes
    cfg = Config(cluster_id=f"t{os.getpid()}-{next(_cluster)}", ipc_dir=d, heartbeat_interval_secs=0.05,
                 worker_timeout_secs=0.6, shutdown_timeout_secs=2.0)
    yield cfg
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def service(config):
    holder: dict = {}
    started = threading.Event()

    def target():
        holder["svc"] = svc = Service(config)
        started.set()
        svc.run()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    assert started.wait(5)
    yield holder["svc"]
    holder["svc"].stop()
    holder["svc"].stop()  # no drain in tests
    t.join(5)
    assert not t.is_alive()


@pytest.fixture
def servers(config):
    made: list[FakeServer] = []

    def make(identity: bytes | None = None) -> FakeServer:
        made.append(FakeServer(config, identity))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def workers():
    made: list[StandInWorker] = []

    def make(config, **kw) -> StandInWorker:
        w = StandInWorker(config, **kw)
        made.append(w)
        w.start()
        return w

    yield make
    for w in made:
        w.stop_now.set()
        w.join(5)
        assert w.error is None, w.error


def collect(server: FakeServer, rids: set[str], timeout: float = 10.0) -> tuple[dict[str, list], list]:
    """Receive until every request in `rids` ended (finish_reason or RequestError)."""
    outs: dict[str, list] = {r: [] for r in rids}
    errors: list[RequestError] = []
    open_ = set(rids)
    batches = []
    deadline = time.monotonic() + timeout
    while open_:
        msg = server.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, TokenBatch):
            batches.append(msg)
            for o in msg.outputs:
                assert o.request_id in rids, f"another server's output: {o.request_id}"
                outs[o.request_id].append(o)
                if o.finish_reason is not None:
                    open_.discard(o.request_id)
        elif isinstance(msg, RequestError):
            errors.append(msg)
            open_.discard(msg.request_id)
    return outs, errors


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.01)


def test_readiness_progress_and_queued_submission(config, service, servers, workers):
    srv = servers()
    pong = srv.ping()
    assert not pong.ready and pong.model is None and "waiting" in pong.status
    w = workers(config, hold_ready=True)
    wait_for(lambda: srv.ping().status == "loading weights 1/2")
    srv.send(make_submit([1, 2, 3], max_tokens=3, rid="early"))  # before Ready: queued, not refused
    wait_for(lambda: srv.ping().stats.num_waiting == 1)
    w.release_ready.set()
    outs, errors = collect(srv, {"early"})
    assert not errors and sum(len(o.token_ids) for o in outs["early"]) == 3
    pong = srv.ping()
    assert pong.ready and pong.status == "ready" and pong.model.model_dir == "/models/stand-in"
    assert pong.stats.num_total_blocks == 64 and pong.stats.num_steps >= 3 and pong.stats.num_running == 0


def test_submit_streams_tokens_to_the_submitting_server(config, service, servers, workers):
    workers(config)
    a, b = servers(b"server-a"), servers(b"server-b")
    wait_for(lambda: a.ping().ready)
    a.send(make_submit(list(range(1, 20)), max_tokens=6, rid="a1"))
    a.send(make_submit(list(range(1, 20)), max_tokens=4, rid="a2", logprobs=True))
    b.send(make_submit([7, 8, 9], max_tokens=5, rid="b1"))
    outs_a, err_a = collect(a, {"a1", "a2"})
    outs_b, err_b = collect(b, {"b1"})
    assert not err_a and not err_b
    assert [len(o.token_ids) for o in outs_a["a1"]] == [1] * 6 and outs_a["a1"][-1].finish_reason == "length"
    assert outs_a["a1"][0].num_prompt_tokens == 19
    assert all(o.logprobs == [-0.5] for o in outs_a["a2"]) and outs_a["a1"][0].logprobs is None
    assert len(outs_b["b1"]) == 5
    # the same prompt again: served from the prefix cache
    a.send(make_submit(list(range(1, 20)), max_tokens=1, rid="a3"))
    outs, _ = collect(a, {"a3"})
    assert outs["a3"][0].num_cached_tokens == 16
    assert a.ping().stats.prefix_cache_hits_tokens >= 16


def test_invalid_requests_are_refused_with_an_error(config, service, servers, workers):
    workers(config, num_blocks=8, block_size=4)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    srv.send(make_submit(list(range(300)), max_tokens=1, rid="long"))  # max_model_len 256
    srv.send(make_submit(list(range(1, 20)), max_tokens=40, rid="big"))  # 58 tokens > 32 slots
    srv.send(make_submit([5000], max_tokens=1, rid="oov"))  # vocab 1000
    huge_k = make_submit([1, 2], max_tokens=1, rid="huge_k")
    srv.send(msgspec.structs.replace(huge_k, sampling=msgspec.structs.replace(huge_k.sampling, top_k=2**40)))
    _, errors = collect(srv, {"long", "big", "oov", "huge_k"})
    codes = {e.request_id: (e.code, e.status) for e in errors}
    assert codes == {"long": ("context_length_exceeded", 400), "big": ("context_length_exceeded", 400),
                     "oov": ("invalid_request", 400), "huge_k": ("invalid_request", 400)}
    assert srv.ping().ready  # nothing reached the worker


def test_abort_mid_stream_and_serving_while_a_step_is_in_flight(config, service, servers, workers):
    w = workers(config, step_delay=0.1)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    srv.send(make_submit([1, 2, 3], max_tokens=200, rid="long"))
    first = srv.recv()
    assert isinstance(first, TokenBatch) and first.outputs[0].request_id == "long"
    t0 = time.monotonic()
    pong = srv.ping()  # answered while step k is in flight (each step takes 100 ms)
    assert time.monotonic() - t0 < 0.09 and pong.stats.num_running == 1
    srv.send(Abort(request_id="long"))
    outs, errors = collect(srv, {"long"})
    assert not errors and outs["long"][-1].finish_reason == "abort" and outs["long"][-1].token_ids == []
    srv.send(make_submit([4, 5], max_tokens=2, rid="next"))
    outs, _ = collect(srv, {"next"})
    assert len(outs["next"]) == 2
    seq_long = w.plans[0].new_seqs[0].seq_id
    assert any(seq_long in p.finished for p in w.plans)  # the worker was told to forget it
    st = srv.ping().stats
    assert st.num_running == 0 and st.num_free_blocks + st.num_cached_blocks == st.num_total_blocks


def test_worker_loss_fails_requests_and_readiness(config, service, servers, workers):
    w = workers(config, step_delay=0.02)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    srv.send(make_submit([1, 2, 3], max_tokens=200, rid="r1"))
    assert isinstance(srv.recv(), TokenBatch)
    w.alive.clear()  # hangs: no heartbeats, no results
    t0 = time.monotonic()
    outs, errors = collect(srv, {"r1"}, timeout=5)
    assert time.monotonic() - t0 < 3
    (err,) = errors
    assert err.code == "worker_lost" and err.status == 503 and "worker" in err.message
    pong = srv.ping()
    assert not pong.ready and "no message from the worker" in pong.status
    srv.send(make_submit([1], max_tokens=1, rid="r2"))  # nothing hangs: refused at once
    _, errors = collect(srv, {"r2"})
    assert errors[0].code == "worker_lost"


def test_fatal_worker_error_fails_requests(config, service, servers, workers):
    w = workers(config, step_delay=0.02)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    srv.send(make_submit([1, 2, 3], max_tokens=200, rid="r1"))
    assert isinstance(srv.recv(), TokenBatch)
    w.fatal = "CUDA error: out of memory"
    _, errors = collect(srv, {"r1"}, timeout=5)
    assert errors[0].code == "worker_lost" and "out of memory" in errors[0].message
    assert not srv.ping().ready


def test_a_dead_worker_is_lost_at_once_and_a_new_one_adopted(config, servers, workers):
    """A worker process that dies closes its connections: the scheduler fails its requests at once, not after
    worker_timeout_secs (30 s here), tells the servers unasked, and adopts the next worker with a fresh KV state."""
    config = msgspec.structs.replace(config, worker_timeout_secs=30.0)
    svc = Service(config)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    try:
        w = workers(config, step_delay=0.02)
        srv = servers()
        wait_for(lambda: srv.ping().ready)
        srv.send(make_submit(list(range(1, 20)), max_tokens=4, rid="warm"))
        collect(srv, {"warm"})
        wait_for(lambda: srv.ping().stats.num_cached_blocks > 0)  # the prefix cache holds blocks of the dead worker
        steps = srv.ping().stats.num_steps
        srv.send(make_submit([1, 2, 3], max_tokens=500, rid="r1"))
        assert isinstance(srv.recv(), TokenBatch)
        w.vanish.set()
        t0 = time.monotonic()
        _, errors = collect(srv, {"r1"}, timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert [(e.code, e.status) for e in errors] == [("worker_lost", 503)]
        assert "connection closed" in errors[0].message
        pong = srv.recv(2, pongs=True)  # unasked: the server need not wait for its next ping
        assert isinstance(pong, Pong) and not pong.ready and "worker was lost" in pong.status
        srv.send(make_submit([1], max_tokens=1, rid="refused"))
        _, errors = collect(srv, {"refused"})
        assert errors[0].code == "worker_lost"

        workers(config)
        pong = srv.recv(5, pongs=True)  # the adoption is announced too
        assert isinstance(pong, Pong) and pong.ready
        st = pong.stats
        assert st.worker_restarts == 1 and st.num_running == 0
        assert st.num_free_blocks == st.num_total_blocks and st.num_cached_blocks == 0  # nothing of the old cache
        assert st.num_steps >= steps  # counters carry over: /metrics never goes back
        srv.send(make_submit(list(range(1, 20)), max_tokens=4, rid="after"))
        outs, errors = collect(srv, {"after"})
        assert not errors and outs["after"][0].num_cached_tokens == 0 and outs["after"][-1].finish_reason == "length"
    finally:
        svc.stop()
        svc.stop()
        t.join(5)


def test_a_raw_connection_to_the_plan_socket_is_not_a_worker(config, service, servers, workers):
    """Only a ZMQ peer's closing counts as the worker's death: a plain socket connect (another scheduler probing
    the file) leaves the worker alone."""
    workers(config)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(config.ipc_path("plan")[len("ipc://"):])
    probe.close()
    srv.send(make_submit([1, 2, 3], max_tokens=5, rid="r"))
    outs, errors = collect(srv, {"r"})
    assert not errors and outs["r"][-1].finish_reason == "length"
    assert srv.ping().ready


def test_stop_drains_and_sends_shutdown_to_the_worker(config, servers, workers):
    svc = Service(config)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    w = workers(config, step_delay=0.01)
    srv = servers()
    wait_for(lambda: srv.ping().ready)
    srv.send(make_submit([1, 2, 3], max_tokens=20, rid="drain"))
    first = srv.recv()
    assert isinstance(first, TokenBatch)
    svc.stop()  # drains: the request in flight still finishes
    srv.send(make_submit([1], max_tokens=1, rid="late"))  # refused while draining
    outs, errors = collect(srv, {"drain", "late"})
    assert [(e.request_id, e.code, e.status) for e in errors] == [("late", "shutting_down", 503)]
    assert len(first.outputs[0].token_ids) + sum(len(o.token_ids) for o in outs["drain"]) == 20
    t.join(5)
    assert not t.is_alive()
    assert w.shutdown_received.wait(2)
    assert not os.path.exists(config.ipc_path("sched")[len("ipc://"):])


def test_draining_pong_and_final_outputs_reach_a_slow_immediate_server(config, servers, workers):
    """While draining, Pongs say so; and the scheduler stays connected a moment after the drain: an IMMEDIATE
    DEALER (infer_server's) drops the messages it has not read yet once its peer disconnects."""
    svc = Service(config)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    workers(config, step_delay=0.01)
    srv = FakeServer(config, immediate=True)
    try:
        wait_for(lambda: srv.ping().ready)
        srv.send(make_submit([1, 2, 3], max_tokens=10, rid="drain"))
        first = srv.recv()
        assert isinstance(first, TokenBatch)
        svc.stop()
        pong = srv.ping()
        assert not pong.ready and pong.status.startswith("shutting down")
        time.sleep(0.3)  # the drain ends meanwhile; this server reads late
        outs, errors = collect(srv, {"drain"})
        assert not errors
        assert len(first.outputs[0].token_ids) + sum(len(o.token_ids) for o in outs["drain"]) == 10
        t.join(5)
        assert not t.is_alive()
    finally:
        srv.close()


def test_queue_and_prefill_time_come_with_the_first_output(config, servers, workers):
    cfg = msgspec.structs.replace(config, max_batch_seqs=1)
    svc = Service(cfg)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    workers(cfg, step_delay=0.03)
    srv = servers()
    try:
        wait_for(lambda: srv.ping().ready)
        srv.send(make_submit([1, 2, 3], max_tokens=6, rid="first"))
        srv.send(make_submit([4, 5, 6], max_tokens=2, rid="second"))  # one sequence per step: it waits
        outs, errors = collect(srv, {"first", "second"})
        assert not errors
        for rid in ("first", "second"):
            assert outs[rid][0].queue_time is not None and outs[rid][0].prefill_time is not None
            assert all(o.queue_time is None and o.prefill_time is None for o in outs[rid][1:])
            assert outs[rid][0].prefill_time >= 0.03  # at least its own prefill step
        assert outs["first"][0].queue_time < 0.15
        assert outs["second"][0].queue_time >= 5 * 0.03  # behind the first request's 6 steps
        # its wait is the queue's, not the prefill's: scheduled once the first request left, with no step ahead
        assert outs["second"][0].prefill_time < outs["second"][0].queue_time
        assert not svc._arrived and not svc._unscheduled and not svc._queue_time
    finally:
        svc.stop()
        svc.stop()
        t.join(5)


def test_a_second_scheduler_on_the_same_cluster_id_is_refused(config):
    """Binding over a live scheduler's sockets would steal its worker and servers: refused with a clear message;
    once the first is gone its stale socket files are reused."""
    first = Service(config)
    try:
        with pytest.raises(RuntimeError, match=f"another scheduler is serving cluster_id '{config.cluster_id}'"):
            Service(config)
        assert os.path.exists(config.ipc_path("sched")[len("ipc://"):])  # the refused one removed nothing
    finally:
        first.monitor.close(linger=0)
        first.router.close(linger=0)
        first.push.close(linger=0)
        first.pull.close(linger=0)  # closed without unlinking: the files stay behind, as after a crash
        first._ctx.term()
    second = Service(config)
    second.close()


def test_a_malformed_result_fails_its_step_and_the_service_goes_on(config, service, servers, workers):
    """A StepResult whose tokens do not match the step (a worker bug) ends that step's requests with an error;
    the other requests and later ones are served normally."""
    srv = servers()
    w = workers(config)
    wait_for(lambda: srv.ping().ready)
    w.corrupt_next = True
    srv.send(make_submit([1, 2, 3], max_tokens=4, rid="hit"))
    outs, errors = collect(srv, {"hit"})
    assert [e.request_id for e in errors] == ["hit"] and "malformed" in errors[0].message
    assert errors[0].status == 500
    srv.send(make_submit([4, 5, 6], max_tokens=4, rid="after"))
    outs, errors = collect(srv, {"after"})
    assert not errors and sum(len(o.token_ids) for o in outs["after"]) == 4
    assert outs["after"][-1].finish_reason == "length"
    wait_for(lambda: srv.ping().stats.num_running == 0)
    stats = srv.ping().stats
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


def test_a_grammar_compiled_while_the_worker_idles_releases_its_held_request(config, service, servers, workers):
    """A constrained request held at its last prompt token, with nothing else to run: no step goes out, so only the
    worker's unsolicited GrammarStatus can release it (or fail it alone: invalid_grammar, 400)."""
    srv = servers()
    w = workers(config, grammar_steps=10**6)  # compiled only while idle, once allowed
    w.compile_while_idle.clear()
    wait_for(lambda: srv.ping().ready)
    srv.send(grammar_submit([1, 2, 3, 4, 5], "g", max_tokens=3))
    srv.send(grammar_submit([6, 7, 8], "bad", schema=BAD_GRAMMAR))
    srv.send(make_submit([9, 10, 11], max_tokens=4, rid="free"))
    outs, errors = collect(srv, {"free"})
    assert not errors and sum(len(o.token_ids) for o in outs["free"]) == 4
    steps = len(w.plans)
    time.sleep(0.2)
    assert len(w.plans) == steps and srv.ping().stats.num_running == 2  # held: admitted, no step runs
    w.compile_while_idle.set()
    outs, errors = collect(srv, {"g", "bad"})
    assert [(e.request_id, e.code, e.status) for e in errors] == [("bad", "invalid_grammar", 400)]
    assert sum(len(o.token_ids) for o in outs["g"]) == 3 and outs["g"][-1].finish_reason == "length"
    wait_for(lambda: srv.ping().stats.num_running == 0)


@pytest.mark.parametrize("slack_ms, joins_after", [(10.0, 1), (0.0, 2)], ids=["paced", "unpaced"])
def test_a_paced_plan_takes_in_a_request_that_arrives_while_the_step_before_runs(config, servers, workers, slack_ms,
                                                                                 joins_after):
    """Steps of 60 ms. Without pacing, step k+1's plan leaves as step k starts, so a request arriving 0-25 ms into
    step k waits for step k+2; held until ~10 ms before step k ends, the plan of step k+1 takes it in."""
    cfg = msgspec.structs.replace(config, plan_slack_ms=slack_ms)
    svc = Service(cfg)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    worker = workers(cfg, step_delay=0.06)
    srv = servers()
    try:
        wait_for(lambda: srv.ping().ready)
        srv.send(make_submit([1, 2, 3], max_tokens=40, rid="stream", ignore_eos=True))
        wait_for(lambda: len(worker.plans) >= 6)  # a few decode steps measured
        running = len(worker.plans)
        wait_for(lambda: len(worker.plans) > running, timeout=1.0)  # a step has just started on the worker
        step_k = worker.plans[-1].step
        srv.send(make_submit([4, 5, 6, 7], max_tokens=2, rid="late"))
        outs, errors = collect(srv, {"stream", "late"})
        assert not errors and len(outs["late"]) >= 1
        stream_seq = worker.plans[0].new_seqs[0].seq_id
        joined = next(p.step for p in worker.plans if any(n.seq_id != stream_seq for n in p.new_seqs))
        assert joined == step_k + joins_after
        stats = srv.ping().stats
        if slack_ms:  # every decode step after the first few measured ones held its successor's plan, in time
            assert stats.plans_held >= 20 and stats.plans_held_past_step_end <= 2
        else:
            assert svc.pacer is None and stats.plans_held == 0
    finally:
        svc.stop()
        svc.stop()
        t.join(5)
