"""Operational endpoints: /health (the process lives), /ready (the engine serves), /metrics (Prometheus)."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from infer_server.errors import retry_after_headers
from infer_server.metrics import CONTENT_TYPE
from infer_server.state import server_state

router = APIRouter()
STARTED = time.monotonic()


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


# HEAD too: load balancers and uptime checkers probe with it (one operation per route in the schema).
@router.head("/health", include_in_schema=False)
@router.get("/health")
async def health() -> Response:
    return _json({"status": "ok"})


@router.head("/ready", include_in_schema=False)
@router.get("/ready")
async def ready(request: Request) -> Response:
    state = server_state(request)
    if state.ready:
        assets = state.loader.assets
        return _json({"status": "ready", "model": assets.served_name if assets else None})
    response = _json({"status": "not_ready", "detail": state.readiness_detail()}, status=503)
    response.headers.update(retry_after_headers(503))
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


# How long a scrape waits for the scheduler's fresh counters before it answers with the last heartbeat's.
METRICS_PONG_TIMEOUT_SECS = 0.5


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    await state.client.fresh_pong(METRICS_PONG_TIMEOUT_SECS)  # the collector reads client.last_pong
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
