"""`rustinfer-worker --config FILE`: load the model, report Ready, then execute step plans until told to stop."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import traceback

from infer_protocol.config import Config, ConfigError, load_config
from infer_protocol.messages import Progress, Ready, Shutdown, StepPlan, WorkerError

from infer_worker.infrastructure.transport import WorkerTransport

log = logging.getLogger("rustinfer.worker")


def serve(config: Config, stop: threading.Event) -> int:
    transport = WorkerTransport(config)
    transport.start_heartbeat()

    def progress(status: str) -> None:
        log.info("%s", status)
        transport.send(Progress(status=status))

    try:
        from infer_worker.infrastructure.bootstrap import bootstrap

        ready = bootstrap(config, progress)
    except Exception as exc:  # start-up failure of any kind: tell the scheduler in one line, then exit
        log.error("start-up failed: %s", exc)
        log.debug("%s", traceback.format_exc())
        transport.send(WorkerError(fatal=True, message=f"worker start-up failed: {exc}"))
        transport.close()
        return 1
    transport.send(Ready(num_blocks=ready.num_blocks, block_size=ready.block_size, model=ready.model))
    code = 0
    while not stop.is_set():
        msg = transport.recv(timeout_ms=100)
        if msg is None:
            continue
        if isinstance(msg, Shutdown):
            log.info("shutdown requested by the scheduler: %s", msg.reason or "no reason given")
            break
        assert isinstance(msg, StepPlan)
        try:
            transport.send(ready.service.step(msg))
        except Exception as exc:
            log.error("step %d failed: %s\n%s", msg.step, exc, traceback.format_exc())
            transport.send(WorkerError(fatal=True, message=f"step {msg.step} failed: {exc}", step=msg.step))
            code = 1
            break
    transport.close()
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rustinfer-worker", description="RustInfer model worker")
    parser.add_argument("--config", help="TOML config file shared by the three processes")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"rustinfer-worker: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s worker %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sys.exit(serve(config, stop))
