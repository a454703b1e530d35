"""One submitted sequence, turned from token outputs into text deltas.

`Generation` owns a request handle, an incremental detokenizer and a stop-string matcher. Each `next()`
returns the text the last step added (possibly "", while a character or a possible stop string is held
back) and, on the last delta, the finish reason. A stop-string hit ends the sequence at once and aborts it
in the scheduler. Closing a generation that has not finished aborts it too (client disconnect, timeout,
error of a sibling choice). `iterate()` interleaves the deltas of n generations (n > 1) as they come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from infer_protocol.messages import PromptLogprobs, RequestError

from infer_server.errors import ApiError
from infer_server.logprobs import TokenLogprob
from infer_server.params import GenerationParams
from infer_server.scheduler_client import SchedulerClient, SchedulerUnavailable
from infer_server.stop_strings import StopStringMatcher
from infer_server.tokenizer import Tokenizer


@dataclass(slots=True)
class Delta:
    index: int
    text: str
    num_tokens: int  # tokens generated in this step
    finish_reason: str | None = None
    # with logprobs: the tokens whose text this delta carries (first emitted, text held back included)
    logprobs: list[TokenLogprob] | None = None


# The worker's codes for a grammar it could not compile (refused, or past its time limit): the request's fault.
GRAMMAR_ERROR_CODES = frozenset({"invalid_grammar", "grammar_too_complex"})


def _request_error(err: RequestError, grammar_param: str | None) -> ApiError:
    status = err.status if 400 <= err.status < 600 else 500
    if grammar_param is not None and err.code in GRAMMAR_ERROR_CODES:
        return ApiError(status, f"'{grammar_param}': {err.message}", code=err.code, param=grammar_param)
    return ApiError(status, err.message, code=err.code or None)


class Generation:
    """A sequence submitted to the scheduler (the constructor submits; ApiError 503 when it cannot)."""

    def __init__(
        self,
        client: SchedulerClient,
        tokenizer: Tokenizer,
        params: GenerationParams,
        request_id: str,
        *,
        index: int = 0,
        timeout: float | None = None,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.params = params
        self.num_tokens = 0
        self.token_ids: list[int] = []  # every generated id, the stop/EOS token included (as counted in usage)
        self.finish_reason: str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None  # with sampling.prompt_logprobs, from the first output
        self.num_cached_tokens = 0  # the prompt tokens the prefix cache served (every output carries it)
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.prefill_time: float | None = None  # the scheduler's, from the first output (first scheduled -> token)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._detok = tokenizer.detokenizer(params.prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop)
        self._want_logprobs = params.sampling.logprobs
        self._pending_logprobs: list[TokenLogprob] = []  # tokens whose text has not been emitted yet
        try:
            self._handle = client.submit(params.submit(request_id), timeout=timeout)
        except SchedulerUnavailable as exc:
            raise ApiError(503, f"The scheduler is unavailable: {exc}", code="scheduler_unavailable") from None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def next(self) -> Delta:
        """The next delta; raises ApiError when the engine reports an error for this sequence."""
        if self.finish_reason is not None:
            raise RuntimeError("generation already finished")
        event = await self._handle.get()
        if isinstance(event, RequestError):
            self._finish("error")
            raise _request_error(event, self.params.grammar_param)
        if event.finish_reason in ("abort", "error"):
            self._finish(event.finish_reason)
            if event.finish_reason == "abort":
                raise ApiError(503, "The request was aborted by the engine.", code="aborted")
            raise ApiError(500, "The engine failed while generating this request.", code="engine_error")
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.prefill_time is not None:
            self.prefill_time = event.prefill_time
        self.num_cached_tokens = event.num_cached_tokens
        if self.params.score_only:  # max_tokens 0: the one token generated to score the prompt is not shown
            self._finish("length")
            self._handle.close()
            return Delta(self.index, "", 0, "length")
        ids = event.token_ids
        now = time.monotonic()
        if ids and self.first_token_at is None:
            self.first_token_at = now
        self.num_tokens += len(ids)
        self.token_ids.extend(ids)
        finish = event.finish_reason
        visible = ids
        if finish == "stop" and ids and ids[-1] in self._stop_ids:
            visible = ids[:-1]  # the stop/EOS token itself is never shown
        text = self._detok.add(visible)
        if finish is not None:
            text += self._detok.flush()
        if self._want_logprobs and event.logprobs is not None:
            tops = event.top_logprobs
            self._pending_logprobs.extend(
                TokenLogprob(t, lp, tops[i] if tops is not None and i < len(tops) else ())
                for i, (t, lp) in enumerate(zip(visible, event.logprobs, strict=False)))
        out, hit = self._stops.push(text)
        if hit:
            self._finish("stop")
            self._handle.close()  # aborts it in the scheduler unless it finished there already
            return Delta(self.index, out, len(ids), "stop", self._take_logprobs())
        if finish is not None:
            out += self._stops.flush()
            self._finish(finish)
            return Delta(self.index, out, len(ids), finish, self._take_logprobs())
        return Delta(self.index, out, len(ids), None, self._take_logprobs() if out else None)

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if not self._want_logprobs:
            return None
        taken, self._pending_logprobs = self._pending_logprobs, []
        return taken

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finished_at = time.monotonic()

    def close(self) -> None:
        """Forget the sequence; abort it in the scheduler if it is still running. Idempotent."""
        self._handle.close()


def start_generations(
    client: SchedulerClient,
    tokenizer: Tokenizer,
    params: Sequence[GenerationParams],
    base_id: str,
    *,
    timeout: float | None,
) -> list[Generation]:
    """Submit every choice; if one cannot be submitted, abort the ones that were."""
    gens: list[Generation] = []
    try:
        for i, p in enumerate(params):
            request_id = base_id if len(params) == 1 else f"{base_id}-{i}"
            gens.append(Generation(client, tokenizer, p, request_id, index=i, timeout=timeout))
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


async def iterate(gens: Sequence[Generation]) -> AsyncGenerator[Delta, None]:
    """Deltas of all generations as they arrive; closes (aborts) every unfinished one on exit."""
    try:
        if len(gens) == 1:
            gen = gens[0]
            while not gen.done:
                yield await gen.next()
            return
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()

        async def pump(gen: Generation) -> None:
            try:
                while not gen.done:
                    queue.put_nowait(await gen.next())
            except Exception as exc:  # handed to the consumer
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(g)) for g in gens]
        try:
            remaining = len(gens)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for g in gens:
            g.close()
