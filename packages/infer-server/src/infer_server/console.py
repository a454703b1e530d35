"""Mounts the optional browser console at `/` when a package provides one through the `rustinfer.static`
entry-point group (the frontend package does); discovery keeps the server from importing the frontend."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse
from starlette.routing import BaseRoute

from infer_server.errors import ApiError

GROUP = "rustinfer.static"
log = logging.getLogger("rustinfer.server")


def console_dir() -> Path | None:
    for ep in entry_points(group=GROUP):
        try:
            path = Path(ep.load()())
        except Exception as exc:  # a broken optional add-on must not stop the API
            log.warning("console entry point %s failed: %s", ep.name, exc)
            continue
        if (path / "index.html").is_file():
            return path
    return None


def mount_console(app: FastAPI, api_routes: Iterable[BaseRoute] = ()) -> bool:
    """Serve the console's files at `/` and `/<file>`. Single-segment routes only: they can never shadow the
    API (a GET on a POST route of `api_routes` still answers 405). False when no console is installed."""
    path = console_dir()
    if path is None:
        return False
    files = {p.name: p for p in path.iterdir() if p.is_file()}
    # `/{name}` also matches a GET of the single-segment API routes (/tokenize): those must answer 405, not 404.
    api_methods = {r.path: sorted(r.methods) for r in api_routes if isinstance(r, APIRoute)}

    async def index() -> FileResponse:
        return FileResponse(files["index.html"])

    async def asset(name: str) -> FileResponse:
        if name not in files:
            methods = api_methods.get(f"/{name}")
            if methods:
                raise HTTPException(405, "Method Not Allowed", headers={"Allow": ", ".join(methods)})
            raise ApiError(404, f"Not found: /{name}", code="not_found")
        return FileResponse(files[name])

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/{name}", asset, methods=["GET"], include_in_schema=False)
    return True
