"""Serve submitted generations as an SSE stream or as one JSON response.

Admission (429) and submission happen before the response starts, so their errors are ordinary HTTP
errors. Afterwards, a streaming failure is an `{"error": ...}` event followed by `[DONE]`; a
non-streaming one is an error response. Either way every unfinished sequence is aborted on exit, also
when the client disconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from infer_server.errors import ApiError
from infer_server.generation import Delta, Generation, iterate, start_generations
from infer_server.logprobs import LogprobsFormatter, TokenLogprob
from infer_server.metrics import ServerMetrics
from infer_server.openai_responses import Kind, ResponseShape, UsageReporting
from infer_server.params import GenerationParams
from infer_server.sse import DONE, EventStreamResponse, sse_event
from infer_server.state import ServerState
from infer_server.tool_calls import parse
from infer_server.tool_stream import ChoiceTools, finish_reason, tool_message
from infer_server.tools import ToolOutput

log = logging.getLogger(__name__)

_ENDPOINT = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class ClientDisconnected(Exception):
    pass


def _record(metrics: ServerMetrics, kind: Kind, gens: Sequence[Generation], error_code: str | None) -> None:
    endpoint = _ENDPOINT[kind]
    if error_code is not None:
        metrics.request_errors.labels(endpoint, error_code).inc()
    metrics.prompt_tokens.inc(sum(len(g.params.prompt_token_ids) for g in gens if g.params.first_choice))
    for g in gens:
        metrics.generation_tokens.inc(g.num_tokens)
        reason = g.finish_reason or "abort"
        metrics.request_finished.labels(endpoint, reason).inc()
        if g.prefill_time is not None:
            metrics.prefill_time.observe(g.prefill_time)
        if g.first_token_at is not None:
            metrics.ttft.observe(g.first_token_at - g.submitted_at)
            if g.finished_at is not None:
                decode_time = g.finished_at - g.first_token_at
                metrics.e2e.observe(g.finished_at - g.submitted_at)
                metrics.decode_time.observe(decode_time)
                if g.prefill_time is not None:
                    metrics.inference_time.observe(g.prefill_time + decode_time)
                if g.num_tokens > 1:
                    metrics.tpot.observe(decode_time / (g.num_tokens - 1))


def _tokens(gens: Sequence[Generation]) -> int:
    """The completion tokens of every choice so far."""
    return sum(g.num_tokens for g in gens)


def _cached(gens: Sequence[Generation]) -> int:
    """The prompt tokens the prefix cache served, each prompt once (from its first choice)."""
    return sum(g.num_cached_tokens for g in gens if g.params.first_choice)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def serve_generation(
    state: ServerState,
    request: Request,
    *,
    kind: Kind,
    params: Sequence[GenerationParams],
    model: str,
    stream: bool,
    prompt_tokens: int,
    usage_reporting: UsageReporting = UsageReporting.NONE,
    return_token_ids: bool = False,
    logprobs: bool = False,
    echo: list[str] | None = None,
    tools: ToolOutput | None = None,
) -> Response:
    """`params`: one per choice, in the order of the response's choice indexes; `prompt_tokens`: the usage's
    prompt tokens (each prompt once, however many choices it has); `logprobs`: format the tokens' logprobs into
    each choice (the sampling params asked the engine for them); `echo`: per choice, the prompt text to put
    before its text; `tools`: read each chat choice's text for tool calls."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    shape = ResponseShape(
        kind=kind,
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        n=len(params),
        prompt_tokens=prompt_tokens,
        usage_reporting=usage_reporting,
        return_token_ids=return_token_ids,
    )
    assets = state.require_assets()
    state.admit()
    try:
        gens = start_generations(state.client, assets.tokenizer, params, shape.id,
                                 timeout=state.config.request_timeout_secs)
    except BaseException:
        state.release()
        raise
    fmt = LogprobsFormatter(kind, assets.tokenizer, len(params)) if logprobs else None
    if stream:
        end = _StreamEnd(state, shape.kind, gens)
        # The response ends the stream too: a response cancelled before its body iterator first ran would never
        # run the iterator's `finally` (closing an unstarted generator skips its body), leaking the admission slot.
        return EventStreamResponse(_events(shape, gens, fmt, echo, end, tools), on_close=end)
    try:
        return await _respond(state, request, shape, gens, fmt, echo, tools)
    finally:
        state.release()


class _StreamEnd:
    """Ends a streamed request once, whoever comes first: its event iterator, or its response (cancelled before the
    iterator started). Aborts every unfinished sequence at the scheduler, gives the admission slot back, records."""

    __slots__ = ("_state", "_kind", "_gens", "_done")

    def __init__(self, state: ServerState, kind: Kind, gens: list[Generation]) -> None:
        self._state = state
        self._kind: Kind = kind
        self._gens = gens
        self._done = False

    def __call__(self, error_code: str | None = "client_disconnected") -> None:
        if self._done:
            return
        self._done = True
        for g in self._gens:
            g.close()
        self._state.release()
        _record(self._state.metrics, self._kind, self._gens, error_code)


async def _events(shape: ResponseShape, gens: list[Generation], fmt: LogprobsFormatter | None,
                  echo: list[str] | None, end: _StreamEnd, tools: ToolOutput | None) -> AsyncGenerator[bytes, None]:
    error_code: str | None = "client_disconnected"
    readers = [ChoiceTools(tools) for _ in range(shape.n)] if tools is not None else None
    try:
        try:
            if shape.kind == "chat":
                for i in range(shape.n):
                    yield sse_event(shape.counted(shape.role_chunk(i), 0, 0))
            # An echo whose prompt logprobs were asked for waits for them: they come with the choice's first output.
            deferred: list[str | None] = [None] * shape.n
            if shape.kind != "chat" and echo:
                for i, text in enumerate(echo):
                    if fmt is not None and gens[i].params.sampling.prompt_logprobs:
                        deferred[i] = text
                    else:
                        yield sse_event(shape.counted(shape.text_chunk(i, text), 0, 0))
            async with aclosing(iterate(gens)) as deltas:
                async for delta in deltas:
                    i = delta.index
                    echoed = deferred[i]
                    if echoed is not None and fmt is not None:
                        deferred[i] = None
                        chunk = shape.text_chunk(i, echoed, _prompt_logprobs(fmt, i, gens[i]))
                        yield sse_event(shape.counted(chunk, _tokens(gens), _cached(gens)))
                    lp = fmt.format(i, delta.logprobs) if fmt is not None and delta.logprobs else None
                    if readers is not None:
                        for chunk in _tool_chunks(shape, readers[i], delta, lp):
                            yield sse_event(shape.counted(chunk, _tokens(gens), _cached(gens)))
                        continue
                    if delta.text or (delta.num_tokens and delta.finish_reason is None):
                        # A token whose text is held back (an incomplete UTF-8 character, a possible stop string)
                        # still gets its chunk, with empty text: as vLLM streams, one chunk a generated token.
                        chunk = shape.text_chunk(i, delta.text, lp)
                        yield sse_event(shape.counted(chunk, _tokens(gens), _cached(gens)))
                        lp = None
                    if delta.finish_reason is not None:
                        chunk = shape.finish_chunk(i, delta.finish_reason, lp)
                        yield sse_event(shape.counted(chunk, _tokens(gens), _cached(gens)))
            if shape.include_usage:
                yield sse_event(shape.usage_chunk(_tokens(gens), _cached(gens)))
            error_code = None
        except ApiError as exc:
            error_code = exc.code or "error"
            log.warning("stream %s failed: %s", shape.id, exc.message)
            yield sse_event(exc.body())
        yield DONE
    finally:
        end(error_code)


def _tool_chunks(shape: ResponseShape, reader: ChoiceTools, delta: Delta,
                 lp: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A delta's chunks when its text is read for tool calls; its logprobs ride on the first (an empty content
    delta carries them while the reader holds the text back)."""
    deltas = reader.feed(delta.text) if delta.text else []
    if delta.finish_reason is not None:
        deltas += reader.finish()
    elif lp is not None and not deltas:
        deltas = [{"content": ""}]
    chunks = []
    for d in deltas:
        chunks.append(shape.delta_chunk(delta.index, d, lp))
        lp = None
    if delta.finish_reason is not None:
        chunks.append(shape.finish_chunk(delta.index, finish_reason(delta.finish_reason, reader.calls > 0), lp))
    return chunks


async def _collect(shape: ResponseShape, gens: list[Generation], fmt: LogprobsFormatter | None,
                   echo: list[str] | None, tools: ToolOutput | None) -> bytes:
    parts: list[list[str]] = [[text] for text in echo] if echo else [[] for _ in range(shape.n)]
    reasons: list[str | None] = [None] * shape.n
    entries: list[list[TokenLogprob]] = [[] for _ in range(shape.n)]
    async with aclosing(iterate(gens)) as deltas:
        async for delta in deltas:
            if delta.text:
                parts[delta.index].append(delta.text)
            if delta.logprobs:
                entries[delta.index].extend(delta.logprobs)
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
    logprobs = None if fmt is None else [_choice_logprobs(fmt, i, g, e)
                                         for i, (g, e) in enumerate(zip(gens, entries, strict=True))]
    texts = ["".join(p) for p in parts]
    messages = None
    if tools is not None:
        messages = [tool_message(parse(tools.format, text), tools) for text in texts]
        reasons = [None if r is None else finish_reason(r, "tool_calls" in m) for r, m in zip(reasons, messages,
                                                                                              strict=True)]
    body = shape.full_response(texts, reasons, _tokens(gens), _cached(gens), [g.token_ids for g in gens], logprobs,
                               messages)
    return msgspec.json.encode(body)


def _prompt_logprobs(fmt: LogprobsFormatter, index: int, gen: Generation) -> dict[str, Any] | None:
    """The echoed prompt's logprobs of a choice (None unless the engine sent them: echo with logprobs)."""
    prompt = gen.prompt_logprobs
    if prompt is None:
        return None
    return fmt.prompt(index, gen.params.prompt_token_ids, prompt.logprobs, prompt.top)


def _choice_logprobs(fmt: LogprobsFormatter, index: int, gen: Generation,
                     entries: list[TokenLogprob]) -> dict[str, Any]:
    """A choice's logprobs: with `echo`, those of its prompt tokens first."""
    echoed = _prompt_logprobs(fmt, index, gen)
    generated = fmt.format(index, entries)
    return generated if echoed is None else {key: echoed[key] + generated[key] for key in echoed}


async def _respond(state: ServerState, request: Request, shape: ResponseShape, gens: list[Generation],
                   fmt: LogprobsFormatter | None, echo: list[str] | None, tools: ToolOutput | None) -> Response:
    error_code: str | None = "client_disconnected"
    work = asyncio.create_task(_collect(shape, gens, fmt, echo, tools))
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientDisconnected
        body = work.result()  # raises the ApiError of a failed generation
        error_code = None
        return Response(content=body, media_type="application/json")
    except ApiError as exc:
        error_code = exc.code or "error"
        raise
    except ClientDisconnected:
        log.info("client left before %s finished: aborted", shape.id)
        return Response(status_code=499)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        for g in gens:
            g.close()
        _record(state.metrics, shape.kind, gens, error_code)
