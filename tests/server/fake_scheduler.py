"""A small but real stand-in for the scheduler: a thread with a ZMQ ROUTER bound to the config's `sched`
IPC path, speaking the real wire messages with the real codecs.

- Ping -> Pong (ready or not, with ModelInfo pointing at a model directory; or no answer when silent).
- Submit -> scripted token ids streamed back, one token per request per step, all requests of one server
  in one TokenBatch per step. A sequence finishes on a token in its stop_token_ids (after min_tokens) with
  "stop", or at max_tokens with "length", like the real scheduler. After the script runs out a filler
  token repeats. With `sampling.logprobs` each token carries `fake_logprob(i)` and `sampling.top_logprobs`
  alternatives, the sampled token first; with `sampling.prompt_logprobs` the first output carries
  `fake_prompt_logprob(position)` for prompt tokens 1.., alternatives alike. Every output reports
  `fake_cached_tokens(prompt length)` prompt tokens served by the prefix cache; the first one the scheduler's
  `FAKE_QUEUE_TIME` and `FAKE_PREFILL_TIME`.
- Abort -> the request is dropped; every Submit and Abort is recorded for the tests to inspect.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from infer_protocol.codec import scheduler_to_server, server_to_scheduler
from infer_protocol.config import Config
from infer_protocol.messages import (
    Abort,
    ModelInfo,
    Ping,
    PromptLogprobs,
    Pong,
    RequestError,
    SchedulerStats,
    Submit,
    TokenBatch,
    TokenOutput,
)


def fake_cached_tokens(num_prompt_tokens: int) -> int:
    """The prefix-cache hit every output reports for a prompt of this length."""
    return num_prompt_tokens // 2


def fake_prompt_logprob(position: int) -> float:
    """The fake logprob of the prompt token at `position` (>= 1), when the sampling asks for prompt logprobs."""
    return -position / 16


# The scheduler's timings on every request's first output (binary fractions: sums stay exact in the tests)
FAKE_QUEUE_TIME = 0.25
FAKE_PREFILL_TIME = 0.125


def fake_logprob(i: int) -> float:
    """The logprob the fake scheduler reports for the i-th generated token of a request asking for them (its
    j-th alternative is `(token + j) % vocab_size` with `fake_logprob(i) - j`)."""
    return -0.125 * (1 + i % 4)


@dataclass
class Reply:
    token_ids: list[int]
    filler: int
    error: RequestError | None = None
    hang: bool = False  # never produce a token
    every: int = 1  # produce a token only every `every` steps (a slow request)


@dataclass
class _Running:
    identity: bytes
    submit: Submit
    reply: Reply
    generated: int = 0


@dataclass
class FakeScheduler:
    config: Config
    model_dir: str
    responder: Callable[[Submit], Reply]
    max_model_len: int = 128
    vocab_size: int = 396
    step_interval: float = 0.002
    ready: bool = True
    silent: bool = False
    images: bool = False  # ModelInfo.images: the "worker" runs a vision tower
    stats: SchedulerStats = field(default_factory=lambda: SchedulerStats(
        num_running=3, num_waiting=2, num_total_blocks=100, num_free_blocks=60, num_cached_blocks=15,
        prefix_cache_queries_tokens=1000, prefix_cache_hits_tokens=250, num_preemptions=4, num_steps=77,
        worker_restarts=2, plans_held=7, plans_held_past_step_end=1))

    def __post_init__(self) -> None:
        self.submits: list[Submit] = []
        self.aborts: list[str] = []
        self.pings = 0
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)
        self._bound = threading.Event()

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()
        if not self._bound.wait(5):
            raise RuntimeError("fake scheduler did not bind")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def submit_for(self, request_id: str) -> Submit:
        with self._lock:
            return next(s for s in self.submits if s.request_id == request_id)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate():
                    return True
            time.sleep(0.005)
        return False

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    # ------------------------------------------------------------------ loop

    def _info(self) -> ModelInfo:
        return ModelInfo(model_dir=self.model_dir, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                         backend="fake", device="cpu", dtype="float32", images=self.images)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.config.ipc_path("sched"))
        self._bound.set()
        decode = server_to_scheduler().decode
        encode = scheduler_to_server().encode
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        step = 0
        try:
            while not self._stop.is_set():
                timeout_ms = int(self.step_interval * 1000) if self._running else 20
                events = dict(poller.poll(max(1, timeout_ms)))
                if sock in events:
                    while True:
                        try:
                            identity, payload = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self.silent:
                            continue
                        self._handle(sock, encode, identity, decode(payload))
                if self._running and not self.silent:
                    step += 1
                    self._step(sock, encode, step)
        finally:
            sock.close(0)
            ctx.term()

    def _handle(self, sock: zmq.Socket, encode: Callable[[object], bytes], identity: bytes, msg: object) -> None:
        if isinstance(msg, Ping):
            self.pings += 1
            pong = Pong(ready=self.ready, stats=self.stats, model=self._info() if self.ready else None,
                        status="ready" if self.ready else "loading weights 1/2")
            sock.send_multipart([identity, encode(pong)])
        elif isinstance(msg, Submit):
            reply = self.responder(msg)
            with self._lock:
                self.submits.append(msg)
                if reply.error is not None:
                    sock.send_multipart([identity, encode(reply.error)])
                    return
                self._running[msg.request_id] = _Running(identity, msg, reply)
        elif isinstance(msg, Abort):
            with self._lock:
                self.aborts.append(msg.request_id)
                self._running.pop(msg.request_id, None)

    def _prompt_logprobs(self, sub: Submit) -> PromptLogprobs | None:
        if not sub.sampling.prompt_logprobs:
            return None
        ids = sub.prompt_token_ids
        lps = [fake_prompt_logprob(p) for p in range(1, len(ids))]
        tops = [[((t + j) % self.vocab_size, lp - j) for j in range(sub.sampling.top_logprobs)]
                for t, lp in zip(ids[1:], lps)]
        return PromptLogprobs(seq_id=-1, start=1, logprobs=lps, top=tops)

    def _step(self, sock: zmq.Socket, encode: Callable[[object], bytes], step: int) -> None:
        by_identity: dict[bytes, list[TokenOutput]] = {}
        with self._lock:
            for rid, run in list(self._running.items()):
                if run.reply.hang or step % run.reply.every:
                    continue
                i = run.generated
                token = run.reply.token_ids[i] if i < len(run.reply.token_ids) else run.reply.filler
                run.generated += 1
                sub = run.submit
                finish = None
                if token in sub.stop_token_ids and run.generated >= sub.min_tokens:
                    finish = "stop"
                elif run.generated >= sub.max_tokens:
                    finish = "length"
                lps, tops = None, None
                if sub.sampling.logprobs:  # "greedy": the sampled token is the most likely one
                    lp = fake_logprob(i)
                    lps = [lp]
                    tops = [[((token + j) % self.vocab_size, lp - j) for j in range(sub.sampling.top_logprobs)]]
                out = TokenOutput(rid, [token], lps, finish, num_prompt_tokens=len(sub.prompt_token_ids),
                                  num_cached_tokens=fake_cached_tokens(len(sub.prompt_token_ids)), top_logprobs=tops,
                                  prompt_logprobs=self._prompt_logprobs(sub) if i == 0 else None,
                                  queue_time=FAKE_QUEUE_TIME if i == 0 else None,
                                  prefill_time=FAKE_PREFILL_TIME if i == 0 else None)
                by_identity.setdefault(run.identity, []).append(out)
                if finish is not None:
                    del self._running[rid]
        for identity, outputs in by_identity.items():
            sock.send_multipart([identity, encode(TokenBatch(step=step, outputs=outputs))])
