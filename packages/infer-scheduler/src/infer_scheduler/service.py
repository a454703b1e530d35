"""The scheduler process: the ZMQ loop around the engine.

Sockets (all bound here, so any start order works):
  ROUTER `sched`  servers' DEALERs: Submit / Abort / Ping in; TokenBatch / RequestError / Pong out, each request's
                  outputs to the server that submitted it, one TokenBatch per step per server.
  PUSH   `plan`   StepPlan / Shutdown to the worker.
  PULL   `result` StepResult / StepFailed / GrammarStatus / Ready / Progress / Heartbeat / WorkerError from the
                  worker.

A worker is lost when its connection to `plan` closes (the kernel closes it the moment the process dies, so a
kill -9 is noticed within a poll, and a busy worker, however long its step, keeps it open), when it reports a
fatal error, or when it is silent for `worker_timeout_secs` (a hung process). Every request it held, running or
waiting, ends with `worker_lost`; the next worker's `Ready` gets a fresh engine (empty allocator and prefix
cache, as its KV cache is empty), and the servers hear of both at once (an unsolicited Pong).

With `enable_overlap` (the default) the pipeline runs one step ahead (docs/architecture.md): step k+1 is planned and sent
right after step k, so the worker has it queued before step k's tokens are back; otherwise it is synchronous
(plan k, wait for result k, plan k+1). One Poller covers every socket, so Submit / Abort / Ping are served while
steps are in flight.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict, deque

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from infer_protocol import codec
from infer_protocol.config import Config, ipc_listener
from infer_protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    GrammarStatus,
    Heartbeat,
    ModelInfo,
    Ping,
    Pong,
    Progress,
    Ready,
    RequestError,
    SchedulerStats,
    Shutdown,
    StepFailed,
    StepResult,
    Submit,
    TokenBatch,
    TokenOutput,
    WorkerError,
)
from infer_protocol.process_gc import tune_gc

from infer_scheduler.engine import Engine, EngineError, ResultMismatch
from infer_scheduler.plan_pacer import PlanPacer
from infer_scheduler.step_timings import StepTimings

log = logging.getLogger("infer_scheduler.service")

_POLL_MS = 50
# The plan socket's connection events: a worker's connection is a peer once its ZMTP handshake succeeded (a raw
# connect, such as another scheduler probing the socket file, never is), and its closing is the worker's death.
_PEER_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_COUNTERS = ("prefix_cache_queries_tokens", "prefix_cache_hits_tokens", "num_preemptions", "num_steps")


def _unlink_ipc(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _claim_ipc(address: str, cluster_id: str) -> None:
    """Remove a stale socket file left by a dead scheduler — but refuse to take over a live one: binding over it
    would silently steal another cluster's workers and servers (a second launcher on the same cluster_id)."""
    if not ipc_listener(address):
        _unlink_ipc(address)  # nobody listens: a leftover, or nothing at all
        return
    path = address[len("ipc://"):]
    raise RuntimeError(f"another scheduler is serving cluster_id {cluster_id!r} at {path}; stop it or set a "
                       "different cluster_id")


class Service:
    def __init__(self, config: Config, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.timings = StepTimings()
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._stop_requests = 0  # a plain counter: safe to bump from a signal handler
        self._from_server = codec.server_to_scheduler()
        self._to_server = codec.scheduler_to_server()
        self._to_worker = codec.scheduler_to_worker()
        self._from_worker = codec.worker_to_scheduler()
        # state
        self.engine: Engine | None = None
        self.model: ModelInfo | None = None
        self.status = "waiting for the worker"
        self.worker_lost = False
        self._last_worker_msg = 0.0
        self._workers_adopted = 0  # Ready messages accepted; every one after the first is a restarted worker
        self._carried = SchedulerStats()  # the counters of earlier workers' engines, so /metrics never goes back
        self._handshaking: deque[int] = deque()  # plan connections (fds) accepted, handshake outcome not seen yet
        self._plan_peers: set[int] = set()  # plan connections (fds) of workers
        self._servers: dict[bytes, float] = {}  # server identity -> when it last pinged
        self._pending: list[Submit] = []  # submissions before the worker is ready
        self._owner: dict[str, bytes] = {}  # request id -> the server's identity
        # queue time (arrival -> first scheduled step), sent with a request's first output
        self._arrived: dict[str, tuple[float, int]] = {}  # not yet scheduled: request id -> (arrival, seq id or -1)
        self._unscheduled: dict[int, str] = {}  # seq id -> request id, for those in the engine
        # scheduled, first output with tokens not sent yet: request id -> (queue time, when first scheduled)
        self._queue_time: dict[str, tuple[float, float]] = {}
        self._out: dict[bytes, list[TokenOutput]] = defaultdict(list)
        self._draining_since: float | None = None
        self._unsent: bytes | None = None  # an encoded plan the PUSH socket could not take yet
        self._unsent_step = (0, 0)  # its (step, tokens)
        # holds the one-step-ahead plan until shortly before the worker needs it (plan_slack_ms; None: never held)
        self.pacer = PlanPacer(config.plan_slack_ms) if config.enable_overlap and config.plan_slack_ms > 0 else None
        self._plan_due: float | None = None  # while a plan is held: when it is due (time.monotonic())
        self._plans_held = 0
        self._plans_held_past_step_end = 0
        self._bind()

    # ------------------------------------------------------------------ sockets

    def _bind(self) -> None:
        cfg = self.config
        self.router = self._ctx.socket(zmq.ROUTER)
        self.push = self._ctx.socket(zmq.PUSH)
        self.pull = self._ctx.socket(zmq.PULL)
        try:
            for sock, chan in ((self.router, "sched"), (self.push, "plan"), (self.pull, "result")):
                sock.setsockopt(zmq.LINGER, 500 if sock is self.router else 0)  # last answers still reach servers
                addr = cfg.ipc_path(chan)
                _claim_ipc(addr, cfg.cluster_id)
                sock.bind(addr)
        except Exception:
            for sock in (self.router, self.push, self.pull):
                sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise
        self.monitor = self.push.get_monitor_socket(_PEER_EVENTS)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        self.push.disable_monitor()
        self.monitor.close(linger=0)
        for sock in (self.router, self.pull, self.push):
            sock.close()
        for chan in ("sched", "plan", "result"):
            _unlink_ipc(self.config.ipc_path(chan))
        if self._own_ctx:
            self._ctx.term()

    # ------------------------------------------------------------------ loop

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def stopping(self) -> bool:
        return self._stop_requests > 0

    def stop(self) -> None:
        """Ask the loop to drain and exit (thread- and signal-safe). A second call exits without draining."""
        self._stop_requests += 1

    def run(self) -> None:
        log.info("scheduler listening on %s", self.config.ipc_path("sched"))
        tune_gc()
        try:
            while True:
                if self.stopping and self._drained():
                    break
                events = dict(self.poller.poll(self._poll_ms()))
                if self.router in events:
                    self._drain(self.router, self._on_server_frames)
                if self.pull in events:
                    self._drain(self.pull, self._on_worker_frames)
                if self.monitor in events:
                    self._drain(self.monitor, self._on_plan_event)
                self._check_worker()
                self._step()
                self._flush()
            self._shutdown_worker()
            self._linger()
        finally:
            self.close()

    def _poll_ms(self) -> int:
        if self._unsent is not None:
            return 2
        if self._plan_due is not None:  # wake for the held plan (never late: `_hold_plan` holds whole milliseconds)
            return max(0, min(_POLL_MS, math.floor((self._plan_due - time.monotonic()) * 1e3)))
        return _POLL_MS

    def _drain(self, sock: zmq.Socket, handle: object) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)  # type: ignore[operator]

    def _drained(self) -> bool:
        """While stopping: finish the requests in flight, for at most shutdown_timeout_secs."""
        now = time.monotonic()
        if self._draining_since is None:
            self._draining_since = now
            log.info("scheduler stopping: draining %d requests", len(self._owner))
        engine = self.engine
        idle = engine is None or (not engine.has_work and not engine.in_flight)
        if idle and not self._pending:
            return True
        if self._stop_requests > 1 or now - self._draining_since > self.config.shutdown_timeout_secs:
            self._fail_everything("shutting_down", "the scheduler is shutting down")
            self._flush()
            return True
        return False

    def _linger(self) -> None:
        """After the drain, keep answering the servers a moment before closing: a server's DEALER is IMMEDIATE,
        and such a socket drops the messages it has not read yet when its peer disconnects, so closing right
        after the last flush could lose the final outputs of the drained requests. Submissions in this window
        are refused (shutting_down) like during the drain."""
        cfg = self.config
        end = time.monotonic() + min(cfg.shutdown_timeout_secs, max(0.5, 2 * cfg.heartbeat_interval_secs))
        while (left := end - time.monotonic()) > 0:
            if self.router.poll(max(1, int(left * 1000)), zmq.POLLIN):
                self._drain(self.router, self._on_server_frames)
                self._flush()

    def _shutdown_worker(self) -> None:
        """Tell the worker to exit (waiting up to 0.5 s for the plan pipe, which may still be connecting)."""
        try:
            self.push.setsockopt(zmq.LINGER, 1000)
            self.push.setsockopt(zmq.SNDTIMEO, 500)
            self.push.send(self._to_worker.encode(Shutdown(reason="scheduler stopped")))
            log.info("sent Shutdown to the worker")
        except zmq.ZMQError as exc:
            log.info("no worker to send Shutdown to (%s)", exc)

    # ------------------------------------------------------------------ servers

    def _on_server_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("dropping a malformed server message (%d frames)", len(frames))
            return
        ident, data = frames
        try:
            msg = self._from_server.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("dropping an undecodable server message: %s", exc)
            return
        if isinstance(msg, Ping):
            self._servers[ident] = time.monotonic()
            self._send(ident, self._pong())
        elif isinstance(msg, Submit):
            self._on_submit(ident, msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg.request_id)

    def _pong(self) -> Pong:
        if self.engine is not None:
            stats = self.timings.add_to(self.engine.stats())
        else:
            stats = SchedulerStats(num_waiting=len(self._pending))
        carried = {name: getattr(stats, name) + getattr(self._carried, name) for name in _COUNTERS}
        stats = msgspec.structs.replace(stats, worker_restarts=max(0, self._workers_adopted - 1),
                                        plans_held=self._plans_held,
                                        plans_held_past_step_end=self._plans_held_past_step_end, **carried)
        status = f"shutting down (draining {len(self._owner)} requests)" if self.stopping else self.status
        return Pong(ready=self.ready and not self.stopping, stats=stats, model=self.model, status=status)

    def _on_submit(self, ident: bytes, msg: Submit) -> None:
        rid = msg.request_id
        err: RequestError | None = None
        if self.stopping:
            err = RequestError(request_id=rid, code="shutting_down", message="the scheduler is shutting down",
                               status=503)
        elif self.worker_lost:
            err = RequestError(request_id=rid, code="worker_lost", message=f"no worker: {self.status}", status=503)
        elif rid in self._owner:
            err = RequestError(request_id=rid, code="invalid_request", message=f"request id {rid!r} is in flight")
        elif not 0 <= msg.sampling.top_k < 2**31:  # the worker's batch holds top_k as int32: it would fail the step
            err = RequestError(request_id=rid, code="invalid_request",
                               message=f"top_k {msg.sampling.top_k} is out of range [0, 2**31)")
        elif self.engine is None:
            self._pending.append(msg)
        else:
            err = self.engine.submit(msg)
        if err is not None:
            self._send(ident, err)
        else:
            self._owner[rid] = ident
            self._arrived[rid] = (time.monotonic(), -1)
            self._track(rid)

    def _tell_servers(self) -> None:
        """An unsolicited Pong to every server that pinged lately: readiness changed (worker lost or adopted), and
        a server should not take new requests, or refuse them, until its next ping."""
        now = time.monotonic()
        recent = 2 * self.config.scheduler_timeout_secs
        self._servers = {ident: seen for ident, seen in self._servers.items() if now - seen < recent}
        if self._servers:
            pong = self._pong()
            for ident in self._servers:
                self._send(ident, pong)

    def _on_abort(self, rid: str) -> None:
        out: TokenOutput | None = None
        for i, msg in enumerate(self._pending):
            if msg.request_id == rid:
                del self._pending[i]
                out = TokenOutput(request_id=rid, token_ids=[], finish_reason="abort",
                                  num_prompt_tokens=len(msg.prompt_token_ids))
                break
        else:
            if self.engine is not None:
                out = self.engine.abort(rid)
        if out is not None:
            self._emit([out])

    def _emit(self, outputs: list[TokenOutput]) -> None:
        owner = self._owner
        for out in outputs:
            ident = owner.get(out.request_id)
            if ident is None:
                continue
            if self._queue_time and out.token_ids:
                timing = self._queue_time.pop(out.request_id, None)
                if timing is not None:
                    queue_time, scheduled_at = timing
                    out = msgspec.structs.replace(out, queue_time=queue_time,
                                                  prefill_time=time.monotonic() - scheduled_at)
            self._out[ident].append(out)
            if out.finish_reason is not None:
                del owner[out.request_id]
                self._forget_timing(out.request_id)

    # ------------------------------------------------------------------ queue and prefill time

    def _track(self, rid: str) -> None:
        """Note the engine's sequence id of a request that just entered the engine."""
        entry = self._arrived.get(rid)
        req = self.engine.requests.get(rid) if self.engine is not None else None
        if entry is not None and req is not None:
            self._arrived[rid] = (entry[0], req.seq_id)
            self._unscheduled[req.seq_id] = rid

    def _scheduled(self, new_seq_ids: list[int]) -> None:
        now = time.monotonic()
        for seq_id in new_seq_ids:
            rid = self._unscheduled.pop(seq_id, None)  # None: a preempted sequence, scheduled before
            if rid is not None:
                entry = self._arrived.pop(rid, None)
                if entry is not None:
                    self._queue_time[rid] = (now - entry[0], now)

    def _forget_timing(self, rid: str) -> None:
        entry = self._arrived.pop(rid, None)
        if entry is not None and entry[1] >= 0:
            self._unscheduled.pop(entry[1], None)
        self._queue_time.pop(rid, None)

    def _flush(self) -> None:
        if not self._out:
            return
        step = self.engine.num_steps if self.engine is not None else 0
        for ident, outs in self._out.items():
            self._send(ident, TokenBatch(step=step, outputs=outs))
        self._out.clear()

    def _send(self, ident: bytes, msg: object) -> None:
        try:
            self.router.send_multipart([ident, self._to_server.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer server %r: %s", ident, exc)

    # ------------------------------------------------------------------ worker

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        try:
            msg = self._from_worker.decode(frames[-1])
        except msgspec.DecodeError as exc:
            log.warning("dropping an undecodable worker message: %s", exc)
            return
        self._last_worker_msg = time.monotonic()
        if isinstance(msg, StepResult):
            if self.engine is None or not self.engine.in_flight:
                return  # a step of a worker we gave up on
            if self.pacer is not None:
                if self._plan_due is not None:  # held past the step's end: the device waits for this plan
                    self._plans_held_past_step_end += 1
                    self._plan_due = None
                self.pacer.finished(msg.step, time.monotonic())
            started = time.perf_counter()
            if msg.seq_errors:
                self._send_errors(self.engine.fail_sequences(msg.seq_errors))
            try:
                self._emit(self.engine.apply_result(msg))
            except ResultMismatch as exc:
                log.error("%s", exc)
                self._fail_step(msg.step, f"the worker's result was malformed: {exc}")
            except EngineError as exc:
                log.error("%s", exc)
            self.timings.result_applied((time.perf_counter() - started) * 1e3, msg.launch_ms, msg.elapsed_ms)
        elif isinstance(msg, GrammarStatus):  # grammars compiled (or failed) while the worker ran no step
            if self.engine is not None:
                self.engine.grammars_ready(msg.ready)
                if msg.errors:
                    self._send_errors(self.engine.fail_sequences(msg.errors))
        elif isinstance(msg, StepFailed):
            log.error("worker step %d failed (%d sequences): %s", msg.step, len(msg.seq_ids), msg.message)
            if self.engine is not None:
                self._fail_step(msg.step, f"the worker failed step {msg.step}: {msg.message}", code="step_failed")
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, Progress):
            if self.engine is None:
                self.status = msg.status
        elif isinstance(msg, WorkerError):
            if msg.fatal:
                self._lose_worker(f"the worker failed: {msg.message}")
            else:
                log.warning("worker error (step %d): %s", msg.step, msg.message)
                if msg.step >= 0:  # that step will send no result
                    self._fail_step(msg.step, f"the worker failed this step: {msg.message}")

    def _fail_step(self, step: int, message: str, code: str = "worker_error") -> None:
        """End the requests of a step that will give no (usable) result, with an error to their servers."""
        if self.engine is None:
            return
        if self.pacer is not None:
            self.pacer.finished(step, time.monotonic())
        self._send_errors(self.engine.fail_step(step, message, code=code))

    def _send_errors(self, errors: list[RequestError]) -> None:
        self._flush()  # the tokens these requests had before the failure reach their servers first
        for err in errors:
            self._forget_timing(err.request_id)
            ident = self._owner.pop(err.request_id, None)
            if ident is not None:
                self._send(ident, err)

    def _on_ready(self, msg: Ready) -> None:
        if msg.version != PROTOCOL_VERSION:
            self._lose_worker(f"the worker speaks protocol {msg.version}, the scheduler {PROTOCOL_VERSION}")
            return
        if self.engine is not None:
            self._lose_worker("the worker restarted")
        try:
            self.engine = Engine.from_config(self.config, msg)
        except ValueError as exc:
            self._lose_worker(f"the worker's Ready is unusable: {exc}")
            return
        self.model = msg.model
        self.worker_lost = False
        self.status = "ready"
        self._workers_adopted += 1
        log.info("worker ready: %d KV blocks of %d tokens, max_model_len %d, model %s", msg.num_blocks,
                 msg.block_size, self.engine.max_model_len, msg.model.model_dir)
        pending, self._pending = self._pending, []
        for sub in pending:
            err = self.engine.submit(sub)
            if err is not None:
                self._forget_timing(sub.request_id)
                ident = self._owner.pop(sub.request_id, None)
                if ident is not None:
                    self._send(ident, err)
            else:
                self._track(sub.request_id)
        self._tell_servers()

    def _on_plan_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind, fd = event["event"], int(event["value"])
        if kind == zmq.EVENT_ACCEPTED:
            self._handshaking.append(fd)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # carries no fd: connections handshake in accept order
            if self._handshaking:
                self._plan_peers.add(self._handshaking.popleft())
        elif kind & _HANDSHAKE_FAILED:
            if self._handshaking:
                self._handshaking.popleft()
        elif kind == zmq.EVENT_DISCONNECTED:
            if fd in self._handshaking:
                self._handshaking.remove(fd)
            elif fd in self._plan_peers:
                self._plan_peers.discard(fd)
                if not self.worker_lost:
                    self._lose_worker("the worker's connection closed (the process exited)")

    def _check_worker(self) -> None:
        if self.engine is None:
            return
        silent = time.monotonic() - self._last_worker_msg
        if silent > self.config.worker_timeout_secs:
            self._lose_worker(f"no message from the worker for {silent:.1f}s")

    def _lose_worker(self, reason: str) -> None:
        log.error("worker lost: %s", reason)
        self._fail_everything("worker_lost", f"the worker was lost: {reason}")
        if self.engine is not None:
            stats = self.engine.stats()
            self._carried = msgspec.structs.replace(
                self._carried, **{name: getattr(self._carried, name) + getattr(stats, name) for name in _COUNTERS})
        self.engine = None
        self._unsent = None
        self._plan_due = None
        if self.pacer is not None:
            self.pacer.reset()
        self.worker_lost = True
        self.status = f"the worker was lost: {reason}"
        self._tell_servers()

    def _fail_everything(self, code: str, message: str) -> None:
        self._flush()  # what finished before the failure is delivered first
        errors: list[RequestError] = []
        if self.engine is not None:
            errors.extend(self.engine.fail_all(code, message, 503))
        errors.extend(RequestError(request_id=s.request_id, code=code, message=message, status=503)
                      for s in self._pending)
        self._pending.clear()
        for err in errors:
            ident = self._owner.pop(err.request_id, None)
            if ident is not None:
                self._send(ident, err)
        self._owner.clear()
        self._arrived.clear()
        self._unscheduled.clear()
        self._queue_time.clear()

    def _step(self) -> None:
        engine = self.engine
        if engine is None:
            return
        while True:
            if self._unsent is None:
                if not engine.can_plan or (engine.has_work and self._hold_plan()):
                    return
                started = time.perf_counter()
                plan = engine.plan_step()
                if plan is None:
                    return
                self.timings.planned((time.perf_counter() - started) * 1e3)
                if self._unscheduled and plan.new_seqs:
                    self._scheduled([ns.seq_id for ns in plan.new_seqs])
                self._unsent = self._to_worker.encode(plan)
                self._unsent_step = (plan.step, engine.last_planned_tokens)
            try:
                self.push.send(self._unsent, zmq.NOBLOCK)
                self._unsent = None
                if self.pacer is not None:
                    self.pacer.sent(*self._unsent_step)
            except zmq.Again:
                # The plan pipe is still connecting (Ready came on the other socket) or the worker is gone:
                # retry next turn; a worker that never takes it is caught by the worker timeout.
                return

    def _hold_plan(self) -> bool:
        """Whether the next plan waits (the pacer's due time not reached); sets `_plan_due` for the poll."""
        if self.pacer is None:
            return False
        lead = (self.timings.plan_ms + self.timings.worker_launch_ms) / 1e3  # planning to queued on the device
        due = self.pacer.due(lead)
        # ZMQ's poll counts whole milliseconds: hold only for one or more, so the wake-up is never after `due`
        held = due is not None and due - time.monotonic() >= 1e-3
        if held and self._plan_due is None:
            self._plans_held += 1
        self._plan_due = due if held else None
        return held
