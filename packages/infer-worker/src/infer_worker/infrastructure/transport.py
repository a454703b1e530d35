"""The worker's ZMQ sockets: plans in (PULL), results out (PUSH), and a heartbeat thread of its own."""

from __future__ import annotations

import threading

import zmq

from infer_protocol import codec
from infer_protocol.config import Config
from infer_protocol.messages import Heartbeat, SchedulerToWorker, WorkerToScheduler


class WorkerTransport:
    def __init__(self, config: Config) -> None:
        self._ctx = zmq.Context.instance()
        self._result_addr = config.ipc_path("result")
        self._plans = self._ctx.socket(zmq.PULL)
        self._plans.connect(config.ipc_path("plan"))
        self._results = self._ctx.socket(zmq.PUSH)
        self._results.setsockopt(zmq.LINGER, 1000)
        self._results.connect(self._result_addr)
        self._in = codec.scheduler_to_worker()
        self._out = codec.worker_to_scheduler()
        self._interval = config.heartbeat_interval_secs
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    def send(self, msg: WorkerToScheduler) -> None:
        self._results.send(self._out.encode(msg), copy=False)

    def recv(self, timeout_ms: int) -> SchedulerToWorker | None:
        if self._plans.poll(timeout_ms, zmq.POLLIN) == 0:
            return None
        return self._in.decode(self._plans.recv(copy=False).buffer)

    def start_heartbeat(self) -> None:
        """Heartbeats come from their own thread and socket, so a long load or step never looks like a death."""

        def beat() -> None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._result_addr)
            payload = self._out.encode(Heartbeat())
            while not self._stop.wait(self._interval):
                sock.send(payload)
            sock.close()

        self._heartbeat_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=2)
        self._plans.close(linger=0)
        self._results.close()
