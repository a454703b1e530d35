"""A small SSE reader for the tests: the `data:` payloads of a streamed response, in order."""

from __future__ import annotations

import json
from typing import Any

import httpx


def stream_events(client: httpx.Client, url: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with client.stream("POST", url, json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
