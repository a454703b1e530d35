"""A small reverse proxy: serves the console's static files and forwards the API to a RustInfer server.

Forwarded paths: ``/v1/*``, ``/metrics`` and ``/metrics/*``, ``/ready``, ``/health``. Responses stream through
unbuffered (SSE token streams arrive chunk by chunk), and when the browser goes away (the stop button aborts
its fetch) the upstream connection is closed at once, so the server sees the disconnect and aborts the
request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from infer_frontend import static_dir

# RFC 9110 §7.6.1 connection-specific headers, plus those the proxy recomputes.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def _forward_headers(headers: httpx.Headers | list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    items = headers.raw if isinstance(headers, httpx.Headers) else headers
    return [(k, v) for k, v in items if k.decode("latin-1").lower() not in _HOP_BY_HOP]


class _UpstreamResponse(Response):
    """Passes an upstream response through as it arrives; on client disconnect, closes the upstream."""

    def __init__(self, upstream: httpx.Response) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.background = None
        raw = _forward_headers(upstream.headers)
        if "content-length" in upstream.headers and "content-encoding" not in upstream.headers:
            raw.append((b"content-length", upstream.headers["content-length"].encode("latin-1")))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    async for chunk in self.upstream.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away while we were sending
                    pass
                except httpx.HTTPError:  # the upstream broke mid-stream: end the response, close the client's side
                    pass
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(server_url: str, *, static: Path | None = None, client: httpx.AsyncClient | None = None) -> Starlette:
    """The console app: static files at ``/``, the API paths proxied to ``server_url``."""
    base = server_url.rstrip("/")
    owns_client = client is None
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=30.0),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        follow_redirects=False,
        trust_env=False,
    )

    async def proxy(request: Request) -> Response:
        url = base + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = _forward_headers(request.headers.raw)
        client_host = request.client.host if request.client else ""
        headers += [(b"x-forwarded-for", client_host.encode()), (b"x-forwarded-proto", request.url.scheme.encode()),
                    (b"x-forwarded-host", request.headers.get("host", "").encode("latin-1"))]
        body = await request.body()
        upstream_request = http.build_request(request.method, url, headers=headers, content=body)
        try:
            upstream = await http.send(upstream_request, stream=True)
        except httpx.TimeoutException as exc:
            return _error(504, f"the RustInfer server at {base} did not answer in time ({type(exc).__name__})", "gateway_timeout")
        except httpx.HTTPError as exc:
            return _error(502, f"cannot reach the RustInfer server at {base}: {exc or type(exc).__name__}", "bad_gateway")
        return _UpstreamResponse(upstream)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owns_client:
                await http.aclose()

    routes = [
        Route("/v1/{path:path}", proxy, methods=_METHODS),
        Route("/metrics", proxy, methods=_METHODS),
        Route("/metrics/{path:path}", proxy, methods=_METHODS),
        Route("/ready", proxy, methods=_METHODS),
        Route("/health", proxy, methods=_METHODS),
        Mount("/", app=StaticFiles(directory=static or static_dir(), html=True), name="console"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server_url = base
    return app

