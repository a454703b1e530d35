"""OpenAI-style errors: one exception type, one body shape, and the FastAPI handlers that use them.

Every failure the server answers, including FastAPI's own validation errors, malformed JSON, unknown
routes and unexpected exceptions, leaves as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


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


# Seconds a client should wait before retrying: a 429 clears as soon as a request finishes; a 503 (engine not
# ready, worker lost and being restarted, draining) takes a worker start at best.
RETRY_AFTER_SECS = {429: 1, 503: 5}


def error_response(err: ApiError) -> Response:
    retry_after = RETRY_AFTER_SECS.get(err.status)
    return Response(
        content=msgspec.json.encode(err.body()), status_code=err.status, media_type="application/json",
        headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
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
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    path = ".".join(loc)
    msg = str(first.get("msg", "invalid value"))
    if kind == "missing":
        if not loc:
            return invalid_request("The request body is missing or is not a JSON object.", code="invalid_json")
        return invalid_request(f"Missing required parameter: '{path}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {path}", param=param, code="unknown_parameter")
    if not loc:
        return invalid_request(f"The request body must be a JSON object: {msg}", code="invalid_json")
    return invalid_request(f"Invalid value for '{path}': {msg}", param=param, code="invalid_value")


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


async def _handle_unexpected(_request: Request, exc: Exception) -> Response:
    log.exception("unhandled error while serving a request")
    return ApiError(500, f"Internal server error: {type(exc).__name__}", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(Exception, _handle_unexpected)
