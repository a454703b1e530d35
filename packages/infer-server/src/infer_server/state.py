"""The per-app state the routes share: config, scheduler client, model assets, metrics, admission."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from infer_protocol.config import Config

from infer_server.errors import ApiError, not_ready
from infer_server.metrics import ServerMetrics
from infer_server.model_assets import ModelAssets, ModelAssetsLoader
from infer_server.scheduler_client import SchedulerClient


@dataclass
class ServerState:
    config: Config
    client: SchedulerClient
    loader: ModelAssetsLoader
    metrics: ServerMetrics
    inflight: int = 0

    @property
    def ready(self) -> bool:
        assets = self.loader.assets
        info = self.client.model_info
        return self.client.ready and assets is not None and info is not None and assets.info == info

    def readiness_detail(self) -> str:
        if not self.client.ready:
            return self.client.status
        if self.loader.error:
            return self.loader.error
        if self.loader.assets is None or self.loader.assets.info != self.client.model_info:
            return "loading the tokenizer and chat template"
        return "ready"

    def require_assets(self, *, scheduler: bool = True) -> ModelAssets:
        """The model assets; 503 until they are loaded (and, for generation, while the engine is not ready)."""
        assets = self.loader.assets
        if scheduler and not self.ready:
            raise not_ready(self.readiness_detail())
        if assets is None:
            raise not_ready(self.readiness_detail())
        return assets

    def admit(self) -> None:
        """Count one more generation request in flight, or refuse it with 429."""
        if self.inflight >= self.config.max_inflight_requests:
            raise ApiError(
                429,
                f"The server is at its limit of {self.config.max_inflight_requests} requests in flight; retry later.",
                code="rate_limit_exceeded",
            )
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)
        self.metrics.inflight.set(self.inflight)


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
