"""Operational endpoints: /health (the process lives), /ready (the engine serves), /metrics (Prometheus)."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from infer_server.errors import RETRY_AFTER_SECS
from infer_server.metrics import CONTENT_TYPE
from infer_server.state import server_state

router = APIRouter()
STARTED = time.monotonic()


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


@router.get("/health")
async def health() -> Response:
    return _json({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    state = server_state(request)
    if state.ready:
        assets = state.loader.assets
        return _json({"status": "ready", "model": assets.served_name if assets else None})
    response = _json({"status": "not_ready", "detail": state.readiness_detail()}, status=503)
    response.headers["Retry-After"] = str(RETRY_AFTER_SECS[503])
    return response


@router.get("/metrics/system")
async def system(request: Request) -> Response:
    """A small JSON summary for dashboards (the browser console's header)."""
    state = server_state(request)
    info = state.client.model_info
    assets = state.loader.assets
    return _json({
        "ready": state.ready,
        "uptime_s": round(time.monotonic() - STARTED, 3),
        "model": assets.served_name if assets else None,
        "model_dir": info.model_dir if info else None,
        "backend": info.backend if info else None,
        "device": info.device if info else None,
        "dtype": info.dtype if info else None,
        "max_model_len": info.max_model_len if info else None,
        "status": state.readiness_detail() if not state.ready else "ready",
    })


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
