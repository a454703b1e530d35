"""OpenAI error bodies and the mapping of FastAPI's validation errors."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError

from infer_server.errors import ApiError, _validation_error, error_type_for, model_not_found, unsupported


def test_api_error_body_shape() -> None:
    err = ApiError(400, "bad", code="invalid_value", param="max_tokens")
    assert err.body() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens",
                                    "code": "invalid_value"}}
    resp = err.response()
    assert resp.status_code == 400 and resp.media_type == "application/json"
    assert resp.body == b'{"error":{"message":"bad","type":"invalid_request_error","param":"max_tokens","code":"invalid_value"}}'


def test_types_by_status() -> None:
    assert error_type_for(404) == "invalid_request_error"
    assert error_type_for(429) == "rate_limit_error"
    assert error_type_for(503) == "server_error"
    assert ApiError(504, "x").type == "server_error"


def test_helpers_name_the_field() -> None:
    e = model_not_found("gpt-x")
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model") and "gpt-x" in e.message
    e = unsupported("logprobs")
    assert (e.status, e.code, e.param) == (400, "unsupported_parameter", "logprobs") and "'logprobs'" in e.message


def _map(*errors: dict) -> ApiError:
    return _validation_error(RequestValidationError(list(errors)))


def test_validation_error_mapping() -> None:
    e = _map({"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}})
    assert (e.status, e.code, e.param) == (400, "invalid_json", None) and "Expecting value" in e.message
    e = _map({"type": "missing", "loc": ("body", "messages"), "msg": "Field required"})
    assert (e.code, e.param) == ("missing_required_parameter", "messages")
    e = _map({"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "Extra inputs are not permitted"})
    assert (e.code, e.param) == ("unknown_parameter", "foo") and "foo" in e.message
    e = _map({"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "Input should be >= 1"},
             {"type": "missing", "loc": ("body", "x"), "msg": "later errors are not reported"})
    assert (e.code, e.param) == ("invalid_value", "max_tokens") and "max_tokens" in e.message
    e = _map({"type": "missing", "loc": ("body",), "msg": "Field required"})
    assert e.code == "invalid_json" and e.param is None
    e = _map({"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"})
    assert e.code == "invalid_json"
