"""`rustinfer-server --config FILE [--<field> VALUE ...]`: the HTTP process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable, Sequence

import uvicorn

from infer_protocol.config import ConfigError
from infer_protocol.config_cli import add_config_arguments, load_config_from_args

PROG = "rustinfer-server"


# Idle keep-alive connections stay open longer than HTTP clients keep them in their pools (httpx 5 s, aiohttp
# 15 s, the OpenAI SDK's httpx 5 s), so the client is the side that closes them. At uvicorn's default (5 s) a
# client reusing a connection just as the server closed it got a connection reset on a POST it cannot retry:
# one such request failed in the qps-32 benchmark.
KEEP_ALIVE_SECS = 75
# uvicorn's own graceful-shutdown timeout comes this long after the server's drain deadline: it cancels the
# requests still open, and a cancelled request answers a bare text/plain 500.
_UVICORN_GRACE_SECS = 2


class DrainingServer(uvicorn.Server):
    """uvicorn, ending its drain at the server's deadline with the OpenAI-format `server_shutdown` error (503, or an
    error event on a stream) for every request still open, aborted at the scheduler, instead of cancelling them."""

    def __init__(self, config: uvicorn.Config, drain_secs: float, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self._drain_secs = drain_secs
        self._on_deadline = on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._drain_secs, self._on_deadline)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="RustInfer OpenAI-compatible HTTP server.")
    add_config_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config_from_args(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s server %(name)s: %(message)s",
    )
    from infer_server.app import create_app  # after the config: a bad config fails fast

    app = create_app(config)
    client = app.state.server.client
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to die by it. A drained shutdown is a
    # clean exit here: these handlers receive that re-raised signal and main returns 0 (130 for Ctrl-C).
    stopped_by: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopped_by.append(signum))
    server = DrainingServer(uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=int(config.shutdown_timeout_secs) + _UVICORN_GRACE_SECS,
        timeout_keep_alive=KEEP_ALIVE_SECS,
    ), drain_secs=config.shutdown_timeout_secs,
        on_deadline=lambda: client.end_all("server_shutdown", "the server is shutting down", 503))
    # Several server processes share the port: each binds it with SO_REUSEPORT and the kernel spreads the
    # connections over them.
    sockets = [_shared_socket(config.host, config.port)] if config.server_processes > 1 else None
    server.run(sockets=sockets)
    return 130 if signal.SIGINT in stopped_by else 0


def _shared_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
