"""OpenAI-style errors: one exception type, one body shape, and the FastAPI handlers that use them.

Every failure the server answers, including FastAPI's own validation errors, malformed JSON, unknown
routes and unexpected exceptions, leaves as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a missing or wrong API key (code "invalid_api_key")
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# 429 and 503 say when to come back (RFC 9110 §10.2.3), and clients (the OpenAI SDK among them) honour the header
# in their retry back-off. In seconds: a 429 clears as soon as a request finishes; a 503 (engine not ready, worker
# lost and being restarted, draining) takes a worker start at best.
RETRY_AFTER_SECS = {429: 1, 503: 5}


def error_type_for(status: int) -> str:
    """The OpenAI `type` for an HTTP status (4xx: the client's fault, 5xx: ours)."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """A failure answered with an OpenAI error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or error_type_for(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        return error_response(self)

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, code={self.code!r}, param={self.param!r})"


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def retry_after_headers(status: int) -> dict[str, str]:
    """The `Retry-After` header of a 429 or a 503 (none for any other status): every such response gets it here."""
    return {"retry-after": str(RETRY_AFTER_SECS[status])} if status in RETRY_AFTER_SECS else {}


def error_response(err: ApiError) -> Response:
    return Response(
        content=msgspec.json.encode(err.body()), status_code=err.status, media_type="application/json",
        headers=retry_after_headers(err.status),
    )


# ------------------------------------------------------------------ common errors


def invalid_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> ApiError:
    suffix = f": {detail}" if detail else ""
    return ApiError(400, f"'{param}' is not supported by this server{suffix}", param=param, code="unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"The model '{model}' does not exist or you do not have access to it.", param="model", code="model_not_found"
    )


def not_ready(detail: str) -> ApiError:
    return ApiError(503, f"The model is not ready to serve requests: {detail}", code="model_not_ready")


# ------------------------------------------------------------------ FastAPI handlers


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = list(exc.errors())
    if not errors:
        return invalid_request("invalid request body")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return invalid_request(f"The request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    raw_loc = [p for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in raw_loc if not _is_union_tag(p)]
    param = str(loc[0]) if loc else None
    path = _path(loc)
    msg = str(first.get("msg", "invalid value"))
    if len(loc) < len(raw_loc):  # a union (prompt: str | [str] | [int] | [[int]]): no single member's error is it
        msg = f"matches none of its accepted types ({_union_members(errors, raw_loc)}): {msg}"
    if kind == "missing":
        if not loc:
            return invalid_request("The request body is missing or is not a JSON object.", code="invalid_json")
        return invalid_request(f"Missing required parameter: '{path}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {path}", param=param, code="unknown_parameter")
    if not loc:
        return invalid_request(f"The request body must be a JSON object: {msg}", code="invalid_json")
    return invalid_request(f"Invalid value for '{path}': {msg}", param=param, code="invalid_value")


# pydantic names the member of a union it tried in the error's location ("str", "list[int]", "ContentPart"); the
# request's own fields are lower-case names, never one of these.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z]+\[.*\]|[A-Z]\w*)$")


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and _UNION_TAG.match(part) is not None


def _path(loc: list[Any]) -> str:
    """`messages[0].content[1].text` from pydantic's ("messages", 0, "content", 1, "text")."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _union_members(errors: list[Any], first_loc: list[Any]) -> str:
    """The union members tried at the first error's union position, in pydantic's order."""
    at = next(i for i, p in enumerate(first_loc) if _is_union_tag(p))
    prefix = first_loc[:at]
    members: list[str] = []
    for e in errors:
        loc = [p for p in e.get("loc", ()) if p != "body"]
        if loc[:at] == prefix and len(loc) > at and _is_union_tag(loc[at]) and loc[at] not in members:
            members.append(str(loc[at]))
    return ", ".join(members)


async def _handle_api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _handle_validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _validation_error(exc).response()


async def _handle_http_exception(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    # 400: a body FastAPI could not parse (e.g. nested too deeply)
    code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(status)
    err = ApiError(status, str(exc.detail), code=code)
    response = err.response()
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def unauthorized(message: str) -> ApiError:
    """401 in OpenAI's shape for a missing or wrong API key."""
    return ApiError(401, message, code="invalid_api_key")


async def _handle_unexpected(_request: Request, exc: Exception) -> Response:
    log.exception("unhandled error while serving a request")
    return ApiError(500, f"Internal server error: {type(exc).__name__}", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(Exception, _handle_unexpected)


def _is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def require_json_content_type(request: Request) -> None:
    """A dependency of the POST routes: a body declared as anything but JSON is refused with 415 naming what was sent
    (FastAPI would not parse it and answer that the body is not an object, which hides the cause). A body without a
    Content-Type is parsed as JSON (the routers set strict_content_type=False): a browser cannot send one without
    it, so this opens no cross-site form post."""
    if request.method != "POST":
        return
    content_type = request.headers.get("content-type")
    if not content_type or _is_json_media_type(content_type):
        return
    raise ApiError(415, f"The request was sent with Content-Type {content_type!r}; the body must be JSON sent with "
                   "'Content-Type: application/json'.", code="unsupported_media_type")
