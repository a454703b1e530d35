"""A small stand-in for the RustInfer server, for the console's tests: a real ASGI app served by a real
uvicorn in a thread. It streams OpenAI-style SSE chat chunks, answers errors in the OpenAI shape, serves
Prometheus text at /metrics whose numbers move at every reading, and records what it saw (request bodies,
headers, client disconnects)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "stand-in-model"
FRANCE_ANSWER = ["The", " capital", " of", " France", " is", " Paris", "."]


@dataclass
class StandInState:
    chat_bodies: list[dict[str, Any]] = field(default_factory=list)
    chat_headers: list[dict[str, str]] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    streamed_tokens: dict[str, int] = field(default_factory=dict)
    metrics_reads: int = 0
    ready: bool = True
    system: bool = True
    seen_origins: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())


def _chunk(rid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_standin(state: StandInState, *, token_delay: float = 0.06, long_delay: float = 0.05) -> Starlette:
    async def models(request: Request) -> Response:
        if origin := request.headers.get("origin"):
            state.seen_origins.append(origin)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "rustinfer"}]})

    async def chat(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not valid JSON")
        with state.lock:
            n = len(state.chat_bodies)
            state.chat_bodies.append(body)
            state.chat_headers.append(dict(request.headers))
        rid = f"chatcmpl-{n}"
        messages = body.get("messages") or []
        last = str(messages[-1].get("content", "")) if messages else ""
        if body.get("model") not in (None, MODEL):
            return _error(404, f"The model `{body.get('model')}` does not exist.", "not_found_error")
        if "please fail" in last:
            return _error(400, "max_tokens is too large: the stand-in refuses this request", "invalid_request_error")

        if body.get("tools") and "weather" in last:  # a tool call, streamed as OpenAI does: name, then arguments
            first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            pieces, delay, finish = [first, '{"city": ', '"Paris"}'], token_delay, "tool_calls"
        elif "France" in last:
            pieces, delay, finish = FRANCE_ANSWER, token_delay, "stop"
        elif "long" in last:
            pieces, delay, finish = [f" word{i}" for i in range(4000)], long_delay, "length"
        else:
            turns = sum(1 for m in messages if m.get("role") == "user")
            pieces, delay, finish = ["You", " said", ":", f" {last}", f" (turn {turns})"], token_delay / 2, "stop"

        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "chat.completion", "model": MODEL,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
                                              "finish_reason": finish}],
                                 "usage": {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}})

        async def stream() -> Any:
            sent = 0
            try:
                yield _chunk(rid, {"role": "assistant", "content": ""})
                for piece in pieces:
                    await asyncio.sleep(delay)
                    if await request.is_disconnected():
                        state.disconnects.append(rid)
                        return
                    if isinstance(piece, dict):
                        yield _chunk(rid, {"tool_calls": [piece]})
                    elif finish == "tool_calls":
                        yield _chunk(rid, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                    else:
                        yield _chunk(rid, {"content": piece})
                    sent += 1
                    state.streamed_tokens[rid] = sent
                yield _chunk(rid, {}, finish)
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 10, "completion_tokens": sent, "total_tokens": 10 + sent}
                    yield f"data: {json.dumps({'id': rid, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
                state.completed.append(rid)
            except (asyncio.CancelledError, GeneratorExit):
                state.disconnects.append(rid)
                raise

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"x-request-id": rid, "cache-control": "no-cache"})

    async def metrics(request: Request) -> Response:
        with state.lock:
            state.metrics_reads += 1
            k = state.metrics_reads
        ttft_count = 2 * k
        ttft_sum = 0.15 * ttft_count
        lines = [
            "# HELP rustinfer_num_requests_running Requests running in the batch.",
            "# TYPE rustinfer_num_requests_running gauge",
            f'rustinfer_num_requests_running{{model_name="{MODEL}"}} {float(k % 4)}',
            "# TYPE rustinfer_num_requests_waiting gauge",
            f'rustinfer_num_requests_waiting{{model_name="{MODEL}"}} {float(k % 3)}',
            "# TYPE rustinfer_kv_cache_usage_ratio gauge",
            f'rustinfer_kv_cache_usage_ratio{{model_name="{MODEL}"}} {(k % 10) / 10 + 0.05}',
            "# TYPE rustinfer_prefix_cache_queries_tokens_total counter",
            f'rustinfer_prefix_cache_queries_tokens_total{{model_name="{MODEL}"}} {100.0 * k}',
            f'rustinfer_prefix_cache_queries_tokens_created{{model_name="{MODEL}"}} 1.7e9',
            "# TYPE rustinfer_prefix_cache_hits_tokens_total counter",
            f'rustinfer_prefix_cache_hits_tokens_total{{model_name="{MODEL}"}} {40.0 * k}',
            "# TYPE rustinfer_num_preemptions_total counter",
            f'rustinfer_num_preemptions_total{{model_name="{MODEL}"}} {float(k // 5)}',
            "# TYPE rustinfer_generation_tokens_total counter",
            f'rustinfer_generation_tokens_total{{model_name="{MODEL}"}} {37.0 * k}',
            f'rustinfer_generation_tokens_created{{model_name="{MODEL}"}} 1.7e9',
            "# TYPE rustinfer_time_to_first_token_seconds histogram",
        ]
        for le, share in (("0.05", 0.0), ("0.1", 0.25), ("0.25", 0.75), ("0.5", 1.0), ("+Inf", 1.0)):
            lines.append(f'rustinfer_time_to_first_token_seconds_bucket{{le="{le}",model_name="{MODEL}"}} {ttft_count * share}')
        lines += [f'rustinfer_time_to_first_token_seconds_count{{model_name="{MODEL}"}} {float(ttft_count)}',
                  f'rustinfer_time_to_first_token_seconds_sum{{model_name="{MODEL}"}} {ttft_sum}']
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def system(request: Request) -> Response:
        if not state.system:
            return _error(404, "Not Found", "not_found_error")
        return JSONResponse({"uptime_s": 3725.0, "model": MODEL, "backend": "stand-in-cpu", "device": "cpu (stand-in)"})

    async def ready(request: Request) -> Response:
        if state.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"method": request.method, "path": request.url.path, "query": request.url.query,
                             "headers": dict(request.headers), "body": body.decode()},
                            headers={"x-request-id": "echo-1", "set-cookie": "a=b"})

    routes = [
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/echo", echo, methods=["GET", "POST", "PUT", "DELETE"]),
        Route("/metrics", metrics),
        Route("/metrics/system", system),
        Route("/ready", ready),
        Route("/health", health),
    ]
    cors = Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    return Starlette(routes=routes, middleware=[cors])


class ServerThread:
    """Serves an ASGI app with a real uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
