"""Pure ASGI middlewares (no BaseHTTPMiddleware: it would break streaming and disconnect detection).

- ApiKeyMiddleware: with `api_key` set, the API needs `Authorization: Bearer <key>` (401 otherwise).
- RequestIdMiddleware: echoes the client's `x-request-id` (or a fresh one) on every response.
- HttpMetricsMiddleware: counts responses by method, endpoint and status (a client that left before any
  response, e.g. while uploading its body, is counted as 499, not as a server error).
- BodyLimitMiddleware: refuses request bodies over `max_request_body_bytes` with 413, bodies that do not arrive
  within `request_body_timeout_secs` with 408, JSON bodies whose strings are not valid Unicode (a lone UTF-16
  surrogate escape such as "\\ud800": the tokenizer and the JSON encoder cannot take such a string) and the
  non-JSON literals `NaN`, `Infinity`, `-Infinity` (Python's json parser accepts them) with 400.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer_server.errors import ApiError, unauthorized
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


class _Constant:
    """A non-JSON literal (NaN, Infinity, -Infinity) found while parsing, kept to name where it was."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _find_constant(value: Any) -> tuple[str, str] | None:
    """(path, literal) of the first non-JSON literal in a value parsed with `parse_constant=_Constant`."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, _Constant):
            return where or "body", item.literal
        if isinstance(item, dict):
            stack.extend((child, f"{where}.{key}" if where else str(key)) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _non_json_literal(body: bytes) -> ApiError | None:
    """JSON (RFC 8259) has no NaN or Infinity, but Python's json, which FastAPI parses with, accepts them; a NaN
    temperature would reach the sampler. Only a body holding one of the words is parsed here a second time."""
    if b"NaN" not in body and b"Infinity" not in body:
        return None
    try:
        parsed = json.loads(body, parse_constant=_Constant)
    except (ValueError, RecursionError):
        return None  # the app answers the malformed JSON itself
    found = _find_constant(parsed)
    if found is None:
        return None  # the words were inside strings
    where, literal = found
    param = where.split(".")[0].split("[")[0] if where != "body" else None
    return ApiError(400, f"Invalid JSON at '{where}': {literal} is not a JSON value (RFC 8259 has no NaN or Infinity); "
                    "send a finite number.", param=param, code="invalid_json")


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
        status: int | None = None

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        failed = True
        try:
            await self.app(scope, receive, send_recording)
            failed = False
        finally:
            # No response and no exception: the client left first (during its upload, say): nginx's 499.
            label = status if status is not None else (500 if failed else 499)
            self.metrics.http_requests.labels(scope.get("method", ""), endpoint, str(label)).inc()


class BodyLimitMiddleware:
    """Reads the body up front (the app reads all of it anyway), refusing it past `limit` bytes or when it has not
    arrived `timeout` seconds after the request's headers (a slow or stalled upload holds a connection and
    memory)."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = 30.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    @staticmethod
    async def _answer(send: Send, err: ApiError, *, close: bool = False) -> None:
        response = err.response()
        if close:  # the rest of the body is never read: the connection cannot carry another request
            response.headers["connection"] = "close"
        await send({"type": "http.response.start", "status": err.status, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def _refuse(self, send: Send) -> None:
        err = ApiError(413, f"The request body exceeds the limit of {self.limit} bytes.", code="request_too_large")
        await self._answer(send, err, close=True)

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
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                err = ApiError(408, f"The request body did not arrive within {self.timeout:g} s.",
                               code="request_timeout")
                await self._answer(send, err, close=True)
                return
            if message["type"] == "http.disconnect":
                return  # the client left mid-upload: nobody to answer (counted as 499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        invalid = _invalid_unicode(body) or _non_json_literal(body)
        if invalid is not None:
            await self._answer(send, invalid)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_OPEN_PATHS = frozenset({"/health", "/ready"})
_METRICS_PATHS = frozenset({"/metrics", "/metrics/system"})
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


def _needs_key(path: str, protect_metrics: bool) -> bool:
    """vLLM's rule: the API (/v1/*) and its tokenizer endpoints need the key; probes, the console's static files
    and the docs stay open, /metrics too unless `api_key_protects_metrics`."""
    if path in _OPEN_PATHS:
        return False
    if path in _METRICS_PATHS:
        return protect_metrics
    return path == "/v1" or path.startswith("/v1/") or path in _KEYED_PATHS


def _key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant-time against every key (no early exit), so the timing tells neither the key nor which one matched."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` with one of `api_key`'s keys, else 401 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = tuple(k.encode("utf-8") for k in keys)
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not _needs_key(scope.get("path", ""), self.protect_metrics):
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if authorization is None:
            err = unauthorized("You didn't provide an API key. You need to provide your API key in an Authorization "
                               "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        else:
            scheme, _, token = authorization.partition(b" ")
            if scheme.lower() == b"bearer" and _key_matches(token.strip(), self.keys):
                await self.app(scope, receive, send)
                return
            err = unauthorized("Incorrect API key provided." if scheme.lower() == b"bearer" else
                               "The Authorization header must use Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        response = err.response()
        response.headers["www-authenticate"] = "Bearer"  # RFC 6750 §3
        await send({"type": "http.response.start", "status": 401, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})
