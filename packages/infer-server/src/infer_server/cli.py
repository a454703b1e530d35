"""`rustinfer-server --config FILE`: the HTTP process."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from infer_protocol.config import ConfigError, load_config

PROG = "rustinfer-server"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="RustInfer OpenAI-compatible HTTP server.")
    p.add_argument("--config", metavar="FILE", help="TOML config shared with the scheduler and the worker")
    p.add_argument("--host", help="override config.host")
    p.add_argument("--port", type=int, help="override config.port")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, overrides={"host": args.host, "port": args.port})
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s server %(name)s: %(message)s",
    )
    import uvicorn  # after the config: a bad config fails fast

    from infer_server.app import create_app

    app = create_app(config)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to die by it. A drained shutdown is a
    # clean exit here: these handlers receive that re-raised signal and main returns 0 (130 for Ctrl-C).
    stopped_by: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopped_by.append(signum))
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=max(1, int(config.shutdown_timeout_secs)),
    )
    return 130 if signal.SIGINT in stopped_by else 0


if __name__ == "__main__":
    sys.exit(main())
