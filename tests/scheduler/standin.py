"""A stand-in worker thread (PULL plans / PUSH results over real ZMQ IPC) and a DEALER acting as the server."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from infer_protocol import codec
from infer_protocol.config import Config
from infer_protocol.messages import (
    Heartbeat,
    ModelInfo,
    Ping,
    Pong,
    Progress,
    Ready,
    Shutdown,
    StepPlan,
    WorkerError,
)

from .sim_worker import SimWorker

MODEL = ModelInfo(model_dir="/models/stand-in", max_model_len=256, vocab_size=1000, backend="sim", device="cpu",
                  dtype="float32")


class StandInWorker(threading.Thread):
    def __init__(self, config: Config, num_blocks: int = 64, block_size: int = 4, step_delay: float = 0.0,
                 hold_ready: bool = False, grammar_steps: int = 0) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sim = SimWorker(num_blocks, block_size, grammar_steps=grammar_steps)
        # while set, the worker reports the grammars that end compiling while it idles (a GrammarStatus)
        self.compile_while_idle = threading.Event()
        self.compile_while_idle.set()
        self.step_delay = step_delay
        self.release_ready = threading.Event()
        if not hold_ready:
            self.release_ready.set()
        self.alive = threading.Event()  # cleared = hung: no heartbeats, no results
        self.alive.set()
        self.stop_now = threading.Event()
        self.vanish = threading.Event()  # set = dies like a killed process: sockets closed, nothing sent
        self.fatal: str | None = None  # set to send a fatal WorkerError
        self.corrupt_next = False  # set to drop the last token of the next result (a malformed StepResult)
        self.shutdown_received = threading.Event()
        self.plans: list[StepPlan] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the tests
            self.error = exc

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        pull.connect(self.config.ipc_path("plan"))
        push.connect(self.config.ipc_path("result"))
        enc, dec = codec.worker_to_scheduler(), codec.scheduler_to_worker()

        def send(msg) -> None:  # never block: with the scheduler gone, a blocking PUSH would hang forever
            try:
                push.send(enc.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                pass

        send(Progress(status="loading weights 1/2"))
        while not self.release_ready.wait(0.02):
            if self.stop_now.is_set():
                return
        send(Ready(num_blocks=self.num_blocks, block_size=self.block_size, model=MODEL))
        last_beat = 0.0
        try:
            while not self.stop_now.is_set() and not self.vanish.is_set():
                if self.fatal is not None:
                    send(WorkerError(fatal=True, message=self.fatal))
                    self.fatal = None
                    self.alive.clear()
                if self.alive.is_set() and time.monotonic() - last_beat > self.config.heartbeat_interval_secs:
                    send(Heartbeat())
                    last_beat = time.monotonic()
                if not pull.poll(10):
                    if self.alive.is_set() and self.compile_while_idle.is_set():
                        status = self.sim.idle_status()
                        if status is not None:
                            send(status)
                    continue
                msg = dec.decode(pull.recv())
                if isinstance(msg, Shutdown):
                    self.shutdown_received.set()
                    return
                if not self.alive.is_set():
                    continue  # hung: swallow the plan
                self.plans.append(msg)
                result = self.sim.step(msg)
                if self.corrupt_next and result.token_ids:
                    self.corrupt_next = False
                    result = msgspec.structs.replace(result, seq_ids=result.seq_ids[:-1],
                                                     token_ids=result.token_ids[:-1])
                if self.step_delay:
                    time.sleep(self.step_delay)
                send(result)
        finally:
            pull.close()
            push.close()


class FakeServer:
    """The server side of the `sched` channel: a DEALER with a decoding receive."""

    def __init__(self, config: Config, identity: bytes | None = None, *, immediate: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if immediate:  # as infer_server's client: unread messages are dropped when the scheduler goes away
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(config.ipc_path("sched"))
        self.enc, self.dec = codec.server_to_scheduler(), codec.scheduler_to_server()

    def send(self, msg) -> None:
        self.sock.send(self.enc.encode(msg))

    def recv(self, timeout: float = 5.0, *, pongs: bool = False):
        """The next message; the scheduler's unsolicited Pongs (readiness changed) are skipped unless `pongs`."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError("no message from the scheduler")
            msg = self.dec.decode(self.sock.recv())
            if pongs or not isinstance(msg, Pong):
                return msg

    def ping(self, timeout: float = 5.0) -> Pong:
        self.send(Ping())
        while True:
            msg = self.recv(timeout, pongs=True)
            if isinstance(msg, Pong):
                return msg

    def close(self) -> None:
        self.sock.close()
