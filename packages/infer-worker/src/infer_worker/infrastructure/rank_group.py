"""The worker's ranks under tensor parallelism: one process per rank, rank 0 being the worker the scheduler
started. Rank 0 spawns ranks 1..N-1 (this same package, its config in the environment), and all of them join one
torch.distributed group over a file store next to the IPC sockets. Each step plan rank 0 receives is broadcast to
the others as its msgpack bytes (gloo, on a group of its own), so every rank runs the same steps in lockstep.

Fail-stop: every broadcast and every collective fails after `tp_operation_timeout_secs` (a hung rank); a rank that
dies ends rank 0 at once (its watchdog) and the others with it (they die with their parent, and a broadcast to a
dead peer fails); rank 0 idle for long sends an empty broadcast so the others can tell a quiet group from a dead
one. The supervisor (`rustinfer serve`) then restarts the worker, the group with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from infer_protocol import codec
from infer_protocol.config import Config
from infer_protocol.messages import SchedulerToWorker

log = logging.getLogger("rustinfer.worker")

RANK_ENV = "INFER_WORKER_TP_RANK"
STORE_ENV = "INFER_WORKER_TP_STORE"
CONFIG_ENV = "INFER_WORKER_TP_CONFIG"
_PR_SET_PDEATHSIG = 1
_WATCH_SECS = 0.05
_EXIT_GRACE_SECS = 5.0


def follower_rank() -> int | None:
    """This process's rank when rank 0 spawned it, else None (it is rank 0 or the only rank)."""
    raw = os.environ.get(RANK_ENV)
    return int(raw) if raw else None


def follower_config() -> Config:
    return msgspec.json.decode(os.environ[CONFIG_ENV], type=Config)


def rank_device(device: str, backend: str, rank: int) -> str:
    """Rank r runs on the r-th device after `device` (`cuda:1` -> rank 1 on `cuda:2`); host ranks share the host."""
    if backend == "cpu":
        return device
    match = re.fullmatch(r"([a-z]+)(?::(\d+))?", device or f"{backend}:0")
    if match is None:
        raise ValueError(f"device {device!r}: expected <type>[:<index>] for tensor_parallel_size > 1")
    return f"{match.group(1)}:{int(match.group(2) or 0) + rank}"


class RankGroup:
    def __init__(self, config: Config, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.world = config.tensor_parallel_size
        self._store = Path(os.environ.get(STORE_ENV) or self._store_path(config))
        self._children: list[subprocess.Popen[bytes]] = []
        self._closing = threading.Event()
        self._codec = codec.scheduler_to_worker()
        self._plans: object | None = None  # the gloo group of the plan broadcasts
        self._last_send = time.monotonic()
        self._keepalive_secs = config.tp_operation_timeout_secs / 4

    @staticmethod
    def _store_path(config: Config) -> Path:
        base = Path(config.ipc_dir or tempfile.gettempdir())
        return base / f"rustinfer-{config.cluster_id}-tp-{os.getpid()}.store"

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        """Rank 0 spawns the others; every rank joins the group (within `tp_startup_timeout_secs`)."""
        if self.rank == 0:
            self._store.unlink(missing_ok=True)
            self._spawn()
        dist.init_process_group("gloo", init_method=f"file://{self._store}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=self.config.tp_startup_timeout_secs))
        self._plans = dist.new_group(backend="gloo",
                                     timeout=timedelta(seconds=self.config.tp_operation_timeout_secs))
        log.info("rank %d of %d joined the group", self.rank, self.world)

    def _spawn(self) -> None:
        env = os.environ | {STORE_ENV: str(self._store), CONFIG_ENV: msgspec.json.encode(self.config).decode()}
        for rank in range(1, self.world):
            self._children.append(subprocess.Popen(
                [sys.executable, "-c", "from infer_worker.cli import main; main([])"],
                env=env | {RANK_ENV: str(rank)}, preexec_fn=_die_with_parent,
            ))
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """A rank that exits while the group runs ends rank 0 at once: the scheduler sees the worker go (its
        in-flight requests end with an error) and the supervisor restarts the whole group."""
        while not self._closing.wait(_WATCH_SECS):
            for rank, child in enumerate(self._children, start=1):
                code = child.poll()
                if code is not None and not self._closing.is_set():
                    log.error("tensor-parallel rank %d exited with code %s: the rank group stops", rank, code)
                    self.kill()
                    logging.shutdown()
                    os._exit(1)

    def barrier(self) -> None:
        """Every rank has loaded its shard (the default group's start-up timeout), before lockstep work."""
        dist.barrier()

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._plans)
        return int(t.item())

    # ------------------------------------------------------------------ the plans

    def send(self, msg: SchedulerToWorker) -> None:
        """Rank 0: the plan (or Shutdown) the scheduler sent, to every other rank."""
        payload = torch.frombuffer(bytearray(self._codec.encode(msg)), dtype=torch.uint8)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)

    def keepalive(self) -> None:
        """Rank 0, idle: an empty broadcast now and then, so the others' waits never reach the timeout."""
        if time.monotonic() - self._last_send >= self._keepalive_secs:
            self._broadcast(torch.zeros(1, dtype=torch.int64))

    def recv(self) -> SchedulerToWorker:
        """Ranks 1..N-1: the next message from rank 0 (empty keep-alives skipped)."""
        while True:
            size = torch.zeros(1, dtype=torch.int64)
            self._broadcast(size)
            if int(size.item()):
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
                self._broadcast(payload)
                return self._codec.decode(payload.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self._plans)
        self._last_send = time.monotonic()

    # ------------------------------------------------------------------ the end

    def close(self, clean: bool) -> None:
        """`clean`: the group is sound, so rank 0 tells the others to stop and waits for them; else (a failed
        step, a failed start) they are killed."""
        self._closing.set()
        if self.rank == 0:
            deadline = time.monotonic() + _EXIT_GRACE_SECS
            for child in self._children if clean else ():
                try:
                    child.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("rank %d did not stop within %.0f s; killed", self._children.index(child) + 1,
                                _EXIT_GRACE_SECS)
            self.kill()
            self._store.unlink(missing_ok=True)
        if clean and dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.kill()
                child.wait()


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when rank 0 dies, however rank 0 dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the group in order
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
