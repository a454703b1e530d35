"""Pure ASGI middlewares (no BaseHTTPMiddleware: it would break streaming and disconnect detection).

- RequestIdMiddleware: echoes the client's `x-request-id` (or a fresh one) on every response.
- HttpMetricsMiddleware: counts responses by method, endpoint and status.
- BodyLimitMiddleware: refuses request bodies over `max_request_body_bytes` with 413, and JSON bodies whose
  strings are not valid Unicode (a lone UTF-16 surrogate escape such as "\\ud800") with 400: the tokenizer
  and the JSON encoder cannot take such a string.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer_server.errors import ApiError
from infer_server.metrics import ServerMetrics

REQUEST_ID_KEY = "rustinfer.request_id"
KNOWN_ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
    "/tokenize", "/detokenize",
})


# a JSON escape in the surrogate range: only then can a parsed string hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) in a parsed JSON value that is not valid Unicode, else None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, where or "body"))
                stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def _invalid_unicode(body: bytes) -> ApiError | None:
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the app answers the malformed JSON itself
    where = _lone_surrogate_path(parsed)
    if where is None:
        return None
    where = where.encode("utf-8", "backslashreplace").decode("utf-8")  # a key on the path may be the culprit
    param = where.split(".")[0].split("[")[0] if where != "body" else None
    return ApiError(400, f"Invalid value for '{where}': a string holds a lone UTF-16 surrogate, which is not valid "
                    "Unicode.", param=param, code="invalid_value")


def request_id_of(scope: Scope) -> str:
    return str(scope.get(REQUEST_ID_KEY, ""))


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= 200 and all(33 <= ord(c) < 127 for c in value)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        rid = given if _valid_request_id(given) else uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = rid
        header = (b"x-request-id", rid.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        try:
            await self.app(scope, receive, send_recording)
        finally:
            self.metrics.http_requests.labels(scope.get("method", ""), endpoint, str(status)).inc()


class BodyLimitMiddleware:
    """Reads the body up front (the app reads all of it anyway), refusing it past `limit` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _refuse(self, send: Send) -> None:
        err = ApiError(413, f"The request body exceeds the limit of {self.limit} bytes.", code="request_too_large")
        response = err.response()
        response.headers["connection"] = "close"
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    await self._refuse(send)
                    return
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        invalid = _invalid_unicode(body)
        if invalid is not None:
            response = invalid.response()
            await send({"type": "http.response.start", "status": 400, "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
