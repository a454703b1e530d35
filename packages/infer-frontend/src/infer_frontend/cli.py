"""``rustinfer-frontend --server URL [--host H] [--port N]``: serve the console and proxy the API to URL."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from infer_frontend.proxy import create_app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rustinfer-frontend",
        description="Serve the RustInfer browser console and reverse-proxy /v1, /metrics, /ready and /health "
        "to a RustInfer server.",
    )
    parser.add_argument("--server", required=True, help="base URL of the RustInfer server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    if not args.server.startswith(("http://", "https://")):
        parser.error(f"--server must be an http:// or https:// URL, got {args.server!r}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    app = create_app(args.server)
    print(f"RustInfer console on http://{args.host}:{args.port}/ (API proxied to {args.server.rstrip('/')})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
