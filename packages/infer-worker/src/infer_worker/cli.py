"""`rustinfer-worker --config FILE [--<field> VALUE ...]`: load the model, report Ready, then execute step plans
until told to stop. With `tensor_parallel_size > 1` this process is rank 0: it forks the other ranks, which
run `follow` (`infrastructure/rank_group.py`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback

from infer_protocol.config import Config, ConfigError
from infer_protocol.config_cli import add_config_arguments, load_config_from_args
from infer_protocol.messages import Progress, Ready, Shutdown, StepPlan, WorkerError
from infer_protocol.process_gc import tune_gc

from infer_worker.application.worker_service import WorkerService
from infer_worker.infrastructure.rank_group import RankGroup
from infer_worker.infrastructure.transport import WorkerTransport

log = logging.getLogger("rustinfer.worker")
# INFER_WORKER_GC=default keeps Python's collector settings in the worker (A/B runs); otherwise it collects as the
# scheduler does (`process_gc.tune_gc`).
GC_ENV = "INFER_WORKER_GC"


def _tune_gc() -> None:
    if os.environ.get(GC_ENV, "tuned").strip() != "default":
        tune_gc()


def serve(config: Config, stop: threading.Event) -> int:
    # The other ranks are forked before any socket or thread exists, so they inherit neither.
    group = RankGroup.fork(config, follow) if config.tensor_parallel_size > 1 else None
    transport = WorkerTransport(config)
    transport.start_heartbeat()

    def progress(status: str) -> None:
        log.info("%s", status)
        transport.send(Progress(status=status))

    try:
        from infer_worker.infrastructure.bootstrap import bootstrap

        ready = bootstrap(config, progress, group)
    except Exception as exc:  # start-up failure of any kind: tell the scheduler in one line, then exit
        log.error("start-up failed: %s", exc)
        log.debug("%s", traceback.format_exc())
        transport.send(WorkerError(fatal=True, message=f"worker start-up failed: {exc}"))
        if group is not None:
            group.close(clean=False)
        transport.close()
        return 1
    _tune_gc()  # before Ready: its full collection never delays a step
    transport.send(Ready(num_blocks=ready.num_blocks, block_size=ready.block_size, model=ready.model,
                         num_state_slots=ready.num_state_slots, graph_step_tokens=list(ready.graph_step_tokens)))
    code = 0
    try:
        run_steps(ready.service, transport, stop, group)
    except FatalStepError as exc:
        # The device is unusable (a CUDA error is sticky), or a rank of the group failed: say so in one line and
        # end the process (and the group), never wedge.
        cause = exc.__cause__
        first_line = (str(cause).strip().splitlines() or [""])[0]
        log.error("step %d failed with a fatal error, the worker exits: %s: %s", exc.step,
                  type(cause).__name__, first_line)
        log.debug("%s", traceback.format_exc())
        transport.send(WorkerError(fatal=True, message=f"step {exc.step} failed: {first_line}", step=exc.step))
        code = 1
    if group is not None:
        group.close(clean=code == 0)
    transport.close()
    return code


def follow(group: RankGroup) -> int:
    """Ranks 1..N-1 (forked by rank 0): start up in lockstep with it, then run every plan it broadcasts, until
    Shutdown; the exit code. Any failure ends this process, which ends the group (rank 0 watches its ranks)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s worker rank {group.rank} %(levelname)s %(message)s"))
    try:
        from infer_worker.infrastructure.bootstrap import bootstrap

        service = bootstrap(group.config, lambda status: log.debug("%s", status), group).service
        _tune_gc()
        while True:
            msg = group.recv()
            if isinstance(msg, Shutdown):
                group.close(clean=True)
                return 0
            assert isinstance(msg, StepPlan)
            service.launch(msg)
            while service.num_inflight > 1 or service.oldest_ready():
                service.collect()  # the tokens become the sequences' own, as on rank 0; the result goes nowhere
    except Exception as exc:
        log.error("rank %d failed, the rank group stops: %s", group.rank, (str(exc).strip().splitlines() or [""])[0])
        log.debug("%s", traceback.format_exc())
        return 1
    finally:
        logging.shutdown()


class FatalStepError(RuntimeError):
    """A step failed in a way that leaves the device unusable (the backend's `is_fatal_error`)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} failed")
        self.step = step


def run_steps(service: WorkerService, transport: WorkerTransport, stop: threading.Event,
              group: RankGroup | None = None) -> None:
    """The step loop. A plan is launched as soon as it arrives, so with the one-step-ahead pipeline step k+1 is
    queued behind step k before step k's tokens are collected; a finished step's result goes out as soon as it
    is ready, and the loop never holds more than one step in flight once the next is queued. A step that fails
    without harming the device comes back from the service as `StepFailed` and goes out in its result's place;
    only a fatal error leaves this loop (as FatalStepError). With a rank `group`, every plan goes to the other
    ranks before this rank launches it."""
    while not stop.is_set():
        while service.oldest_ready():
            _send_oldest(service, transport)
        busy = service.num_inflight > 0
        compiling = not busy and service.compiling
        if compiling and (status := service.grammar_status()) is not None:
            transport.send(status)  # no result will carry it: the scheduler may hold the row and have nothing else
        msg = transport.recv(timeout_ms=0 if busy else _COMPILE_POLL_MS if compiling else 100)
        if msg is None:
            if busy:
                time.sleep(_SPIN_SECS)  # wait for the step on the device or the next plan, whichever comes first
            elif group is not None:
                _keepalive(group)
            continue
        if isinstance(msg, Shutdown):
            log.info("shutdown requested by the scheduler: %s", msg.reason or "no reason given")
            return
        assert isinstance(msg, StepPlan)
        try:
            if group is not None:
                group.send(msg)
            early = service.launch(msg)
        except Exception as exc:
            raise FatalStepError(msg.step) from exc
        for result in early:
            transport.send(result)
        while service.num_inflight > 1:  # step k+1 is queued: now wait for step k
            _send_oldest(service, transport)


_SPIN_SECS = 20e-6
_COMPILE_POLL_MS = 2  # how often an idle worker looks at the grammars compiling (a held row waits for that report)


def _keepalive(group: RankGroup) -> None:
    try:
        group.keepalive()
    except Exception as exc:  # a rank died or hangs while the group was idle
        raise FatalStepError(-1) from exc


def _send_oldest(service: WorkerService, transport: WorkerTransport) -> None:
    step = service.oldest_step
    try:
        result = service.collect()
    except Exception as exc:
        raise FatalStepError(step) from exc
    transport.send(result)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rustinfer-worker", description="RustInfer model worker")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config_from_args(args)
    except ConfigError as exc:
        print(f"rustinfer-worker: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s worker %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = serve(config, stop)
    if code:
        # After a fatal device error, interpreter shutdown would run CUDA teardown on a broken context (which can
        # hang): leave at once, the logs flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

