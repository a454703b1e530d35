"""The FastAPI application factory."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from infer_protocol.config import Config

from infer_server import routes_openai, routes_system, routes_tokenize
from infer_server.console import mount_console
from infer_server.errors import install_error_handlers
from infer_server.metrics import ServerMetrics
from infer_server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, HttpMetricsMiddleware, RequestIdMiddleware
from infer_server.model_assets import ModelAssetsLoader
from infer_server.scheduler_client import SchedulerClient
from infer_server.state import ServerState

__version__ = "0.1.0"
log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def create_app(config: Config, client: SchedulerClient | None = None) -> FastAPI:
    """The OpenAI-compatible app for `config`.

    The app's lifespan starts the scheduler client (one is made from `config` unless given) and closes it
    at shutdown; the model's tokenizer and template are loaded when the first ready Pong names the model.
    """
    client = client if client is not None else SchedulerClient(config)
    loader = ModelAssetsLoader(config)
    client.add_pong_listener(loader.on_pong)
    state = ServerState(config=config, client=client, loader=loader, metrics=ServerMetrics(client))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await loader.close()
            await client.close()

    if not config.api_keys and not _is_loopback(config.host):
        log.warning("the server binds %s without an api_key: anyone who reaches it can use the API", config.host)
    app = FastAPI(
        title="RustInfer",
        version=__version__,
        summary="OpenAI-compatible LLM inference server",
        lifespan=lifespan,
        # Starlette's slash redirects build an absolute URL from the client's Host header (an open redirect).
        redirect_slashes=False,
    )
    app.state.server = state
    install_error_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_tokenize.router)
    app.include_router(routes_system.router)
    if config.enable_console:
        mount_console(app, [*routes_openai.router.routes, *routes_tokenize.router.routes])
    # Added innermost first: a request passes RequestId -> HttpMetrics -> ApiKey -> BodyLimit -> routes (a request
    # without the key is refused before its body is read).
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes,
                       timeout=config.request_body_timeout_secs)
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys, protect_metrics=config.api_key_protects_metrics)
    app.add_middleware(HttpMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(RequestIdMiddleware)
    return app
