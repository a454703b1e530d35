"""The server's side of the server <-> scheduler channel: an asyncio ZMQ DEALER.

One socket, connected to `config.ipc_path("sched")`. Every request gets a `RequestHandle` with its own
asyncio queue; the receive loop decodes each `TokenBatch` once and hands every `TokenOutput` to the queue
of its request (outputs of unknown or aborted requests are dropped). A ping loop sends `Ping` every
`heartbeat_interval_secs` and keeps the latest `Pong`: the scheduler is *ready* while that Pong says ready
and is younger than `scheduler_timeout_secs`. When the scheduler goes silent, or reports that it lost its
worker, every in-flight request receives an error, so nothing waits forever.

All sends are non-blocking: the DEALER is `IMMEDIATE` (no queueing for a peer that is not connected), so
a submit while the scheduler is away fails at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeAlias, cast

import zmq
import zmq.asyncio

from infer_protocol.codec import scheduler_to_server, server_to_scheduler
from infer_protocol.config import Config
from infer_protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    ModelInfo,
    Ping,
    Pong,
    RequestError,
    SchedulerToServer,
    Submit,
    TokenBatch,
    TokenOutput,
)

log = logging.getLogger(__name__)

Event: TypeAlias = TokenOutput | RequestError
PongListener: TypeAlias = Callable[[Pong], None]
QueueTimeListener: TypeAlias = Callable[[float], None]


class SchedulerUnavailable(RuntimeError):
    """A message could not be handed to the scheduler (not connected, or the client is closed)."""


class RequestHandle:
    """The receiving end of one submitted request."""

    __slots__ = ("request_id", "_client", "_queue", "_finished", "_closed", "_timer")

    def __init__(self, client: SchedulerClient, request_id: str) -> None:
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._finished = False  # the scheduler is done with it (finish_reason or error seen)
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    async def get(self) -> Event:
        """The next output or error of this request (in arrival order)."""
        queue = self._queue
        if not queue.empty():
            return queue.get_nowait()
        return await queue.get()

    def close(self) -> None:
        """Forget the request; tell the scheduler to abort it unless it already finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._client._forget(self)

    # ---- called by the client
    def _deliver(self, event: Event, *, final: bool) -> None:
        if final:
            self._finished = True
        self._queue.put_nowait(event)

    def _expire(self, timeout: float) -> None:
        self._timer = None
        if not self._finished and not self._closed:
            msg = f"the request did not finish within request_timeout_secs={timeout:g} s"
            self._queue.put_nowait(RequestError(self.request_id, code="timeout", message=msg, status=504))


class SchedulerClient:
    """asyncio DEALER client of the scheduler. Create anywhere; `start()` inside the serving event loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.address = config.ipc_path("sched")
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._handles: dict[str, RequestHandle] = {}
        self._encode = server_to_scheduler().encode
        self._decode = scheduler_to_server().decode
        self._listeners: list[PongListener] = []
        self._queue_time_listeners: list[QueueTimeListener] = []
        self._last_pong: Pong | None = None
        self._last_pong_at = 0.0
        self._pong_waiters: list[asyncio.Future[Pong]] = []
        self._last_message_at = 0.0
        self._was_ready = False
        self._draining = False  # not ready, but the scheduler still finishes what it holds
        self._started_at = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._sock is not None

    async def start(self) -> None:
        if self._sock is not None:
            return
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.address)
        self._sock = sock
        self._started_at = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="rustinfer-server-recv"),
            asyncio.create_task(self._ping_loop(), name="rustinfer-server-ping"),
        ]
        log.info("connecting to the scheduler at %s", self.address)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self._fail_all("server_shutdown", "the server is shutting down", 503)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ state

    @property
    def last_pong(self) -> Pong | None:
        return self._last_pong

    @property
    def model_info(self) -> ModelInfo | None:
        return self._last_pong.model if self._last_pong is not None else None

    @property
    def pong_age(self) -> float | None:
        return None if self._last_pong is None else time.monotonic() - self._last_pong_at

    @property
    def ready(self) -> bool:
        pong = self._last_pong
        return (
            pong is not None
            and pong.ready
            and pong.version == PROTOCOL_VERSION
            and time.monotonic() - self._last_pong_at < self.config.scheduler_timeout_secs
        )

    @property
    def status(self) -> str:
        """A human line: why the scheduler is (not) ready."""
        pong = self._last_pong
        if pong is None:
            waited = time.monotonic() - self._started_at
            return f"waiting for the scheduler at {self.address} ({waited:.0f} s)"
        if pong.version != PROTOCOL_VERSION:
            return f"scheduler speaks protocol version {pong.version}, this server {PROTOCOL_VERSION}"
        age = time.monotonic() - self._last_pong_at
        if age >= self.config.scheduler_timeout_secs:
            return f"the scheduler has been silent for {age:.1f} s"
        if not pong.ready:
            return pong.status or "the scheduler is not ready (worker loading)"
        return pong.status or "ready"

    @property
    def num_inflight(self) -> int:
        return len(self._handles)

    def add_pong_listener(self, listener: PongListener) -> None:
        self._listeners.append(listener)

    def add_queue_time_listener(self, listener: QueueTimeListener) -> None:
        """Called with each request's queue time (scheduler arrival -> first scheduled step), as it arrives."""
        self._queue_time_listeners.append(listener)

    # ------------------------------------------------------------------ requests

    def submit(self, msg: Submit, *, timeout: float | None = None) -> RequestHandle:
        """Register and send a request; raises SchedulerUnavailable when it cannot be handed over."""
        if msg.request_id in self._handles:
            raise ValueError(f"duplicate request id {msg.request_id!r}")
        handle = RequestHandle(self, msg.request_id)
        self._handles[msg.request_id] = handle
        try:
            self._send(msg)
        except SchedulerUnavailable:
            del self._handles[msg.request_id]
            handle._closed = True
            raise
        if timeout is not None and timeout > 0:
            handle._timer = asyncio.get_running_loop().call_later(timeout, handle._expire, timeout)
        return handle

    async def fresh_pong(self, timeout: float) -> Pong | None:
        """A Pong sent after this call (so its stats include everything this server has seen the scheduler do), by
        pinging now and waiting up to `timeout` for the answer; the latest Pong when none comes in time. A /metrics
        scrape uses it: between heartbeats the last Pong's counters lag (prefix-cache hits read 0 right after a
        request that hit). Concurrent callers share one Ping."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Pong] = loop.create_future()
        first = not self._pong_waiters
        self._pong_waiters.append(waiter)
        try:
            if first:
                self._send(Ping())
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except (SchedulerUnavailable, TimeoutError):
            return self._last_pong
        finally:
            if waiter in self._pong_waiters:
                self._pong_waiters.remove(waiter)
            if not waiter.done():
                waiter.cancel()

    def abort(self, request_id: str) -> None:
        try:
            self._send(Abort(request_id))
        except SchedulerUnavailable:
            log.debug("abort of %s not delivered: scheduler unavailable", request_id)

    def end_all(self, code: str, message: str, status: int) -> None:
        """Ends every open request: aborted at the scheduler, and `code` delivered to its caller as an error."""
        for request_id in list(self._handles):
            self.abort(request_id)
        self._fail_all(code, message, status)

    def _forget(self, handle: RequestHandle) -> None:
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
        if not handle._finished:
            self.abort(handle.request_id)

    def _send(self, msg: Submit | Abort | Ping) -> None:
        sock = self._sock
        if sock is None:
            raise SchedulerUnavailable("the scheduler client is not started")
        fut = cast("asyncio.Future[Any]", sock.send(self._encode(msg), flags=zmq.NOBLOCK))
        if not fut.done():  # cannot happen with NOBLOCK and no queued sends; never leave an exception unread
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return
        exc = fut.exception()
        if isinstance(exc, zmq.Again):
            raise SchedulerUnavailable(f"the scheduler is not connected at {self.address}")
        if exc is not None:
            raise SchedulerUnavailable(f"sending to the scheduler failed: {exc}")

    # ------------------------------------------------------------------ loops

    async def _recv_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            frames = await sock.recv_multipart(copy=True)
            try:
                msg = self._decode(frames[-1])
            except Exception as exc:  # a bad message must not stop the loop
                log.error("undecodable message from the scheduler: %s", exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: SchedulerToServer) -> None:
        self._last_message_at = time.monotonic()
        if isinstance(msg, TokenBatch):
            handles = self._handles
            for out in msg.outputs:
                if out.queue_time is not None:
                    for on_queue_time in self._queue_time_listeners:
                        on_queue_time(out.queue_time)
                handle = handles.get(out.request_id)
                if handle is None:
                    continue
                final = out.finish_reason is not None
                if final:
                    del handles[out.request_id]
                handle._deliver(out, final=final)
        elif isinstance(msg, RequestError):
            handle = self._handles.pop(msg.request_id, None)
            if handle is not None:
                handle._deliver(msg, final=True)
            elif msg.request_id:
                log.debug("error for unknown request %s: %s", msg.request_id, msg.message)
            else:
                log.error("scheduler error: %s", msg.message)
        elif isinstance(msg, Pong):
            self._on_pong(msg)

    def _on_pong(self, pong: Pong) -> None:
        if pong.version != PROTOCOL_VERSION and (self._last_pong is None or self._last_pong.version != pong.version):
            log.error("scheduler protocol version %d != server protocol version %d", pong.version, PROTOCOL_VERSION)
        self._last_pong = pong
        self._last_pong_at = time.monotonic()
        # Any Pong read now left the scheduler after every message read before it (one ordered pipe): fresh enough.
        waiters, self._pong_waiters = self._pong_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(pong)
        held = pong.stats.num_running + pong.stats.num_waiting
        if pong.ready and pong.version == PROTOCOL_VERSION:
            if not self._was_ready:
                log.info("scheduler ready (%s)", pong.model.model_dir if pong.model else "no model info")
            self._was_ready = True
            self._draining = False
        elif self._was_ready and pong.version == PROTOCOL_VERSION and held > 0:
            # Not ready but still running requests: the scheduler is draining (SIGTERM). It answers every
            # request it holds, so none is failed here; new ones are refused while it is not ready.
            if not self._draining:
                self._draining = True
                log.warning("scheduler stopped admitting requests (%s); %d still running", pong.status, held)
        elif self._was_ready:
            self._was_ready = False
            self._draining = False
            reason = pong.status or "the scheduler lost its worker"
            log.error("scheduler no longer ready: %s", reason)
            self._fail_all("worker_lost", f"the engine stopped serving: {reason}", 503)
        for listener in self._listeners:
            try:
                listener(pong)
            except Exception:
                log.exception("pong listener failed")

    async def _ping_loop(self) -> None:
        interval = self.config.heartbeat_interval_secs
        timeout = self.config.scheduler_timeout_secs
        ping = Ping()
        while True:
            try:
                self._send(ping)
            except SchedulerUnavailable:
                pass
            now = time.monotonic()
            silent = now - max(self._last_message_at, self._started_at)
            if self._handles and silent > timeout:
                log.error("the scheduler has been silent for %.1f s: failing %d requests", silent, len(self._handles))
                message = f"the scheduler stopped responding ({silent:.1f} s without a message)"
                self._fail_all("scheduler_lost", message, 503)
            if self._was_ready and now - self._last_pong_at > timeout:
                self._was_ready = False
                log.error("no pong from the scheduler for %.1f s", now - self._last_pong_at)
            await asyncio.sleep(interval)

    def _fail_all(self, code: str, message: str, status: int) -> None:
        handles, self._handles = self._handles, {}
        for request_id, handle in handles.items():
            handle._deliver(RequestError(request_id, code=code, message=message, status=status), final=True)
