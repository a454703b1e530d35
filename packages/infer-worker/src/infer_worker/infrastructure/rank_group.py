"""The worker's ranks under tensor parallelism: one process per rank, rank 0 being the worker the scheduler
started. Rank 0 forks ranks 1..N-1 first thing, before it opens a socket or starts a thread (so the children
share its imported modules and inherit no ZMQ state); they wait on a pipe until rank 0 has checked the model for
tensor parallelism, then all N join one torch.distributed group over a file store next to the IPC sockets. Each
step plan rank 0 receives is broadcast to the others as its msgpack bytes (gloo, on a group of its own), so every
rank runs the same steps in lockstep.

Fail-stop: every broadcast and every collective fails after `tp_operation_timeout_secs` (a hung rank); a rank that
dies ends rank 0 at once (a watcher thread per rank) and the others with it (the kernel kills a rank whose parent
died: `PR_SET_PDEATHSIG`); rank 0 idle for long sends an empty broadcast so the others can tell a quiet group from
a dead one. The supervisor (`rustinfer serve`) then restarts the worker, the group with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from infer_protocol import codec
from infer_protocol.config import Config
from infer_protocol.messages import SchedulerToWorker, Shutdown

log = logging.getLogger("rustinfer.worker")

_PR_SET_PDEATHSIG = 1
_EXIT_GRACE_SECS = 5.0
_GO = b"g"


def rank_device(device: str, backend: str, rank: int) -> str:
    """Rank r runs on the r-th device after `device` (`cuda:1` -> rank 1 on `cuda:2`); host ranks share the host."""
    if backend == "cpu":
        return device
    match = re.fullmatch(r"([a-z]+)(?::(\d+))?", device or f"{backend}:0")
    if match is None:
        raise ValueError(f"device {device!r}: expected <type>[:<index>] for tensor_parallel_size > 1")
    return f"{match.group(1)}:{int(match.group(2) or 0) + rank}"


class _Rank:
    """A forked rank seen from rank 0: its pid, the pipe that lets it start, and a thread that waits for its end."""

    def __init__(self, rank: int, pid: int, go: int, on_exit: Callable[[int, int], None]) -> None:
        self.rank, self.pid, self.go = rank, pid, go
        self.code: int | None = None
        self._on_exit = on_exit
        self.waiter = threading.Thread(target=self._wait, name=f"rank-{rank}-waiter", daemon=True)

    def _wait(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        self.code = os.waitstatus_to_exitcode(status)
        self._on_exit(self.rank, self.code)


class RankGroup:
    def __init__(self, config: Config, rank: int, store: Path, go: int | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world = config.tensor_parallel_size
        self._store = store
        self._go = go  # ranks 1..N-1: the pipe rank 0 writes to once the model passed its checks
        self._ranks: list[_Rank] = []
        self._closing = threading.Event()
        self._codec = codec.scheduler_to_worker()
        self._plans: object | None = None  # the gloo group of the plan broadcasts
        self._last_send = time.monotonic()
        self._keepalive_secs = config.tp_operation_timeout_secs / 4

    @classmethod
    def fork(cls, config: Config, follow: Callable[["RankGroup"], int]) -> "RankGroup":
        """Rank 0's group; the other ranks are forked here, each runs `follow(its group)` and exits with its
        code (this never returns in them). Call before opening sockets or starting threads."""
        base = Path(config.ipc_dir or tempfile.gettempdir())
        store = base / f"rustinfer-{config.cluster_id}-tp-{os.getpid()}.store"
        store.unlink(missing_ok=True)
        group = cls(config, 0, store)
        parent = os.getpid()
        for rank in range(1, group.world):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                for other in group._ranks:
                    os.close(other.go)
                _become_rank(parent)
                os._exit(follow(cls(config, rank, store, read_end)))
            os.close(read_end)
            group._ranks.append(_Rank(rank, pid, write_end, group._rank_exited))
        for child in group._ranks:
            child.waiter.start()
        return group

    def _rank_exited(self, rank: int, code: int) -> None:
        """A rank that exits while the group runs ends rank 0 at once: the scheduler sees the worker go (its
        in-flight requests end with an error) and the supervisor restarts the whole group."""
        if self._closing.is_set():
            return
        log.error("tensor-parallel rank %d exited with code %s: the rank group stops", rank, code)
        self.kill()
        logging.shutdown()
        os._exit(1)

    # ------------------------------------------------------------------ start-up

    def start(self) -> bool:
        """Rank 0 lets the others go; every rank joins the group (within `tp_startup_timeout_secs`). False in a
        rank that rank 0 stopped before it could start (a refused model: rank 0 reports it)."""
        if self.rank == 0:
            for child in self._ranks:
                os.write(child.go, _GO)
                os.close(child.go)
        else:
            assert self._go is not None
            went = os.read(self._go, 1) == _GO
            os.close(self._go)
            if not went:
                return False
        dist.init_process_group("gloo", init_method=f"file://{self._store}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=self.config.tp_startup_timeout_secs))
        self._plans = dist.new_group(backend="gloo",
                                     timeout=timedelta(seconds=self.config.tp_operation_timeout_secs))
        log.info("rank %d of %d joined the group", self.rank, self.world)
        return True

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
        self._closing.set()  # first: a rank that stops from here on is expected to
        if self.rank == 0 and clean:
            self.send(Shutdown(reason="the worker stops"))
        if self.rank == 0:
            deadline = time.monotonic() + _EXIT_GRACE_SECS
            for child in self._ranks if clean else ():
                child.waiter.join(timeout=max(0.0, deadline - time.monotonic()))
                if child.waiter.is_alive():
                    log.warning("rank %d did not stop within %.0f s; killed", child.rank, _EXIT_GRACE_SECS)
            self.kill()
            self._store.unlink(missing_ok=True)
        if clean and dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        for child in self._ranks:
            if child.code is None:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:  # it has just exited
                    pass
        for child in self._ranks:
            if child.waiter.is_alive() and child.waiter is not threading.current_thread():
                child.waiter.join(timeout=_EXIT_GRACE_SECS)


def _become_rank(parent: int) -> None:
    """In a forked rank: die with rank 0, however it dies; leave Ctrl-C and SIGTERM to rank 0, which stops the
    group in order."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the line above
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
