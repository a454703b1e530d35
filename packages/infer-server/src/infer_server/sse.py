"""Server-sent events: the framing, and a response that notices a client leaving while it waits.

Starlette's StreamingResponse (ASGI 2.4) only learns of a disconnect when its next write fails, and then
leaves the body iterator unclosed. A request waiting for tokens must be aborted as soon as the client is
gone, so this response races the stream against `http.disconnect` and closes the event iterator (whose
cleanup aborts the request in the scheduler) either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse_event(payload: Any) -> bytes:
    """One `data:` event holding `payload` as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_close = on_close  # runs after the iterator is closed, whether or not it ever started
        self.status_code = 200
        self.background = None
        merged = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        merged.update(headers or {})
        self.init_headers(merged)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._stream(send))
        watcher = asyncio.create_task(self._wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not stream.done():
                stream.cancel()  # the client left (or we are being cancelled): stop generating
            watcher.cancel()
            for task in (stream, watcher):
                try:
                    await task
                except (asyncio.CancelledError, OSError):  # cancelled above, or the client is gone
                    pass
                except Exception as exc:
                    log.warning("event stream ended with an error: %r", exc)
            try:
                await self.events.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()
