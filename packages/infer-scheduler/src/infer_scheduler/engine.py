"""The scheduler engine: pure logic, no I/O. submit / abort / plan_step / apply_result.

Up to `max_inflight_steps` steps are in flight. With 1 the pipeline is synchronous: `plan_step` returns the
`StepPlan` of step k, `apply_result` takes `StepResult` k, and only then is step k+1 planned. With 2 it is the
one-step-ahead pipeline (docs/architecture.md): step k+1 is planned right after k is dispatched, as if every request
that samples in step k already had its token (a PENDING placeholder in `token_ids`; the worker gathers the real id on
the device). Result k writes the tokens in place and applies the stop rules; a request that stopped at k was
already planned into k+1, so its k+1 token is discarded and the worker forgets it in plan k+2; an abort while
steps are in flight discards their tokens the same way. A request preempted while a step in flight samples its
token keeps that token (so a preemption never loses progress, as in the synchronous pipeline) and is re-admitted
only once the token is known.

A request with a grammar (`sampling.structured`) is held at its last prompt token until the worker reports its
grammar compiled (`grammars_ready`: `StepResult.grammars_ready`, or a `GrammarStatus` sent while no step runs); a
grammar that fails comes as a `SeqError` (`fail_sequences`) and ends that request alone.

Stop rules, applied to each sampled token: a token in `stop_token_ids` once more than `min_tokens` tokens are
out ("stop"; the server adds EOS to stop_token_ids unless the request says `ignore_eos`); `max_tokens`
tokens out, or the context reaching `max_model_len` ("length"). The stop token is part of `token_ids`. (The worker
also masks the stop ids until `sampling.min_tokens` tokens are out, from the ids each NewSeq carries, so the
min_tokens rule here only matters for a Submit whose sampling.min_tokens is lower than its own.)
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import repeat

from infer_core.plan import FinishReason, blocks_needed
from infer_protocol.config import Config
from infer_protocol.messages import (
    Ready,
    RequestError,
    SchedulerStats,
    SeqError,
    StepPlan,
    StepResult,
    Submit,
    TokenOutput,
)

from infer_scheduler.kv_manager import KvCacheManager
from infer_scheduler.planner import Counters, Planner, Schedule
from infer_scheduler.policy import FcfsPolicy
from infer_scheduler.request import NO_STATE_SLOT, Request, RequestStatus

log = logging.getLogger("infer_scheduler.engine")

_STOP = FinishReason.STOP.value
_LENGTH = FinishReason.LENGTH.value


class EngineError(RuntimeError):
    """The engine was driven out of order (a step planned while another is in flight, a foreign result)."""


def _image_span_error(msg: Submit) -> str | None:
    """Why the images' placeholder spans do not fit the prompt (in order, disjoint, inside it), or None."""
    end = 0
    for i, image in enumerate(msg.images):
        if image.offset < end or image.num_tokens < 1 or image.offset + image.num_tokens > len(msg.prompt_token_ids):
            return (f"image {i}'s placeholders [{image.offset}, {image.offset + image.num_tokens}) do not lie in the "
                    f"prompt of {len(msg.prompt_token_ids)} tokens after those of the image before it")
        end = image.offset + image.num_tokens
    return None


class ResultMismatch(EngineError):
    """A result does not match its step's sampling sequences; the step stays in flight for `fail_step`."""


class Engine:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_batch_tokens: int = 8192,
        max_batch_seqs: int = 256,
        chunked_prefill_size: int = 2048,
        prefill_tokens_while_decoding: int = 0,
        idle_prefill_uses_step_budget: bool = False,
        graph_step_tokens: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
        vocab_size: int = 0,
        max_inflight_steps: int = 1,
        num_state_slots: int = 0,
    ) -> None:
        """`num_state_slots`: the worker's state slots (a hybrid model's; 0 = none). With any, prefix caching is
        off whatever `enable_prefix_caching` says (logged)."""
        if max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {max_model_len}")
        if max_inflight_steps not in (1, 2):
            raise ValueError(f"max_inflight_steps must be 1 or 2, got {max_inflight_steps}")
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        if num_state_slots and enable_prefix_caching:
            log.warning("prefix caching is off: the model has linear-attention layers, whose per-sequence state is "
                        "valid only at the exact end of a prefix (%d state slots)", num_state_slots)
            enable_prefix_caching = False
        self.kv = KvCacheManager(num_blocks, block_size, enable_prefix_caching, num_state_slots)
        self.policy = FcfsPolicy(max_batch_tokens, max_batch_seqs, chunked_prefill_size,
                                 prefill_tokens_while_decoding, idle_prefill_uses_step_budget, graph_step_tokens)
        self.counters = Counters()
        self.planner = Planner(self.policy, self.kv, self.counters)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._next_seq_id = 1
        self._to_forget: list[int] = []  # seq ids for the next plan's `finished`
        self.max_inflight_steps = max_inflight_steps
        self._inflight: deque[Schedule] = deque()  # oldest first
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: Config, ready: Ready) -> Engine:
        """The engine for a worker that just sent `Ready` (its cache geometry and model limits)."""
        lens = [n for n in (config.max_model_len, ready.model.max_model_len) if n > 0]
        max_len = min(lens) if lens else ready.num_blocks * ready.block_size
        return cls(num_blocks=ready.num_blocks, block_size=ready.block_size, max_model_len=max_len,
                   max_batch_tokens=config.max_batch_tokens, max_batch_seqs=config.max_batch_seqs,
                   chunked_prefill_size=config.chunked_prefill_size,
                   prefill_tokens_while_decoding=config.prefill_tokens_while_decoding,
                   idle_prefill_uses_step_budget=config.idle_prefill_uses_step_budget,
                   graph_step_tokens=tuple(ready.graph_step_tokens),
                   enable_prefix_caching=config.enable_prefix_caching,
                   vocab_size=ready.model.vocab_size, max_inflight_steps=2 if config.enable_overlap else 1,
                   num_state_slots=ready.num_state_slots)

    # ------------------------------------------------------------------ requests in

    def submit(self, msg: Submit) -> RequestError | None:
        """Queue a request; a `RequestError` instead when it is invalid or could never fit."""
        rid = msg.request_id
        p = len(msg.prompt_token_ids)
        err = None
        if rid in self.requests:
            err = ("invalid_request", f"request id {rid!r} is already in flight")
        elif p == 0:
            err = ("invalid_request", "the prompt holds no tokens")
        elif msg.max_tokens < 1:
            err = ("invalid_request", f"max_tokens must be >= 1, got {msg.max_tokens}")
        elif p >= self.max_model_len:
            err = ("context_length_exceeded",
                   f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                   f"{p} tokens, which leaves no room to generate.")
        elif self.vocab_size and (min(msg.prompt_token_ids) < 0 or max(msg.prompt_token_ids) >= self.vocab_size):
            err = ("invalid_request", f"prompt token ids must be in [0, {self.vocab_size})")
        elif (bad := _image_span_error(msg)) is not None:
            err = ("invalid_request", bad)
        else:
            kv_tokens = min(p + msg.max_tokens, self.max_model_len) - 1
            need = blocks_needed(kv_tokens, self.kv.block_size)
            if need > self.kv.num_blocks:
                cap = self.kv.num_blocks * self.kv.block_size
                err = ("context_length_exceeded",
                       f"The request needs {kv_tokens + 1} tokens of context ({p} prompt + {msg.max_tokens} "
                       f"max_tokens) but the KV cache holds only {cap} tokens ({self.kv.num_blocks} blocks of "
                       f"{self.kv.block_size}); lower max_tokens or shorten the prompt.")
        if err is not None:
            return RequestError(request_id=rid, code=err[0], message=err[1], status=400)
        req = Request(msg, self._next_seq_id, self.max_model_len)
        self._next_seq_id += 1
        self.requests[rid] = req
        self._by_seq[req.seq_id] = req
        self.waiting.append(req)
        return None

    def abort(self, request_id: str) -> TokenOutput | None:
        """End a request now (its blocks are freed; the worker forgets it at the next step)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, FinishReason.ABORT)
        return TokenOutput(request_id=request_id, token_ids=[], finish_reason=FinishReason.ABORT.value,
                           num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0))

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish(reason)
        self.kv.release(req, keep_in_cache=reason is not FinishReason.ERROR)
        del self.requests[req.request_id]
        del self._by_seq[req.seq_id]
        if req.on_worker:
            self._to_forget.append(req.seq_id)
            req.on_worker = False

    # ------------------------------------------------------------------ steps

    @property
    def in_flight(self) -> bool:
        return bool(self._inflight)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def last_planned_tokens(self) -> int:
        """Tokens the most recently planned step computes (0 with none in flight)."""
        return self._inflight[-1].num_tokens if self._inflight else 0

    @property
    def can_plan(self) -> bool:
        """Another step may be planned now (fewer than `max_inflight_steps` are in flight)."""
        return len(self._inflight) < self.max_inflight_steps

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan_step(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute (forgotten ids wait for a real step)."""
        if len(self._inflight) >= self.max_inflight_steps:
            raise EngineError(f"steps {[s.step for s in self._inflight]} are still in flight")
        if not self.running and not self.waiting:
            return None
        step = self.num_steps + 1
        sched = self.planner.schedule(step, self.running, self.waiting)
        if sched.num_seqs == 0:
            if sched.preempted:  # e.g. a lone request preempted itself while its token is in flight
                self._to_forget.extend(sched.preempted)
            return None
        self.num_steps = step
        self._mark_samplers(sched)
        self._inflight.append(sched)
        finished, self._to_forget = self._to_forget, []
        plan = StepPlan(step=step, new_seqs=sched.new_seqs, continuing=sched.continuing, finished=finished,
                        preempted=sched.preempted)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d new, %d continuing, %d tokens, %d finished, %d preempted; running %d waiting %d "
                      "free blocks %d", step, len(plan.new_seqs), len(plan.continuing), sched.num_tokens,
                      len(finished), len(plan.preempted), len(self.running), len(self.waiting), self.kv.num_free)
        return plan

    def _mark_samplers(self, sched: Schedule) -> None:
        """A PENDING token for every request whose step reaches the end of its tokens, in the worker's order
        (new sequences, then continuing ones: decodes before prefill chunks, as the planner emitted them)."""
        samplers = sched.samplers
        by_seq = self._by_seq
        admitted = [by_seq[ns.seq_id] for ns in sched.new_seqs]
        chunked = sched.prefilling[:len(sched.prefilling) - len(admitted)]  # _prefills appended before _admit
        for req in admitted:
            if req.num_computed == len(req.token_ids):
                samplers.append((req, req.add_pending()))
        for req in sched.decoding:
            samplers.append((req, req.add_pending()))
        for req in chunked:
            if req.num_computed == len(req.token_ids):
                samplers.append((req, req.add_pending()))

    def grammars_ready(self, seq_ids: list[int]) -> None:
        """The worker compiled these sequences' grammars: their first sample may be planned from now on (a request
        that ended meanwhile, or was already released, is no matter)."""
        by_seq = self._by_seq
        for sid in seq_ids:
            req = by_seq.get(sid)
            if req is not None:
                req.awaits_grammar = False

    def apply_result(self, result: StepResult) -> list[TokenOutput]:
        """Take the sampled tokens of the oldest step in flight; the outputs to stream (finished ones included)."""
        sched = self._take_oldest(result)
        if result.grammars_ready:
            self.grammars_ready(result.grammars_ready)
        for chunk in result.prompt_logprobs:
            owner = self._by_seq.get(chunk.seq_id)
            if owner is not None:
                owner.absorb_prompt_logprobs(chunk)
        outputs, done = self._write_tokens(sched, result)
        kv = self.kv
        # Cache the prompt pages this step computed, not those of a step still in flight: that one may fail.
        for req, end in zip(sched.prefilling, sched.prefill_ends):
            if req.status is RequestStatus.RUNNING:
                kv.cache_computed(req, upto=end)
        if done:
            self._retire(done)
        return outputs

    def _take_oldest(self, result: StepResult) -> Schedule:
        """The step in flight `result` answers (it must be the oldest, and match its sampling sequences)."""
        if not self._inflight or result.step != self._inflight[0].step:
            raise EngineError(f"result of step {result.step}, but steps {[s.step for s in self._inflight]} "
                              f"are in flight")
        samplers = self._inflight[0].samplers
        if len(result.seq_ids) != len(samplers) or len(result.token_ids) != len(samplers):
            # A protocol bug: the PENDING tokens can never be filled, so the step must fail (fail_step).
            raise ResultMismatch(f"step {result.step}: {len(result.token_ids)} sampled tokens for {len(samplers)} "
                                 "sampling sequences")
        return self._inflight.popleft()

    def _write_tokens(self, sched: Schedule, result: StepResult) -> tuple[list[TokenOutput], list[Request]]:
        """Write each sampled token over its PENDING placeholder and apply the stop rules to it; the outputs to
        stream, and the requests the step finished. The scheduler's hot loop, one pass: the rules are inlined here
        rather than a Request method, whose call per token cost ~7% of apply_result (bench/scheduler_step.py)."""
        outputs: list[TokenOutput] = []
        out_append = outputs.append
        done: list[Request] = []
        finished_ = RequestStatus.FINISHED
        lps = result.logprobs if result.logprobs is not None else repeat(None)
        tops = result.top_logprobs if result.top_logprobs is not None else repeat(None)
        for (req, idx), sid, tok, lp, top in zip(sched.samplers, result.seq_ids, result.token_ids, lps, tops):
            if req.status is finished_:
                continue  # finished or aborted while the step was in flight: the token is void
            if req.seq_id != sid:
                log.error("step %d: token for seq %d where seq %d was due; ignored", result.step, sid, req.seq_id)
                continue
            req.token_ids[idx] = tok
            req.num_pending -= 1
            n = idx + 1
            # The stop rules (their one place): a stop token once more than min_tokens are out, winning over the
            # length limit (max_tokens, max_model_len) it may reach at the same time.
            reason = _STOP if n > req.min_len and tok in req.stop_token_ids else _LENGTH if n >= req.max_len else None
            if req.prompt_lps is not None:  # its first output (rare: echo with logprobs)
                out_append(TokenOutput(req.request_id, [tok], None if lp is None else [lp], reason,
                                       req.num_prompt_tokens, req.num_cached_tokens, None if top is None else [top],
                                       prompt_logprobs=req.take_prompt_logprobs()))
            elif req.want_logprobs and lp is not None:
                out_append(TokenOutput(req.request_id, [tok], [lp], reason, req.num_prompt_tokens,
                                       req.num_cached_tokens, None if top is None else [top]))
            else:
                out_append(TokenOutput(req.request_id, [tok], None, reason, req.num_prompt_tokens,
                                       req.num_cached_tokens))
            if reason is not None:
                req.finish_reason = FinishReason(reason)
                done.append(req)
        return outputs, done

    def _retire(self, done: list[Request]) -> None:
        """End the requests a step finished: out of the running set (or the queue, for one preempted while the
        step that finished it was in flight), their blocks released or cached."""
        preempted = [req for req in done if req.status is RequestStatus.WAITING]
        for req in preempted:  # its last token came back after a preemption
            self.waiting.remove(req)
        for req in done:
            self._finish(req, req.finish_reason)  # type: ignore[arg-type]
        if len(done) - len(preempted) < 8:
            for req in done:
                if req not in preempted:
                    self.running.remove(req)
        else:  # many at once: one pass over the running set beats a list.remove per request
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def fail_step(self, step: int, message: str, code: str = "worker_error", status: int = 500) -> list[RequestError]:
        """The worker reports that step `step` failed (no result will come): end the requests it held.

        With the one-step-ahead pipeline the step after it may already be planned with those requests; the worker
        leaves them out of that step's result (StepFailed), so they leave its sampling rows here too."""
        sched = next((s for s in self._inflight if s.step == step), None)
        if sched is None:
            return []
        self._inflight.remove(sched)
        seq_ids = [ns.seq_id for ns in sched.new_seqs] + [c.seq_id for c in sched.continuing]
        failed = set(seq_ids)
        for later in self._inflight:
            if later.step > step:
                later.samplers = [entry for entry in later.samplers if entry[0].seq_id not in failed]
        errors: list[RequestError] = []
        for sid in seq_ids:
            req = self._by_seq.get(sid)
            if req is not None:
                errors.append(self._fail_request(req, code, message, status))
        return errors

    def _fail_request(self, req: Request, code: str, message: str, status: int) -> RequestError:
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, FinishReason.ERROR)
        return RequestError(request_id=req.request_id, code=code, message=message, status=status)

    def fail_sequences(self, errors: list[SeqError]) -> list[RequestError]:
        """The worker reports sequences that failed on their own (StepResult.seq_errors): end their requests. Their
        tokens in this step and in steps planned before now are void (the result loop skips finished requests);
        the worker forgets them when the next plan names them as finished."""
        out: list[RequestError] = []
        for err in errors:
            req = self._by_seq.get(err.seq_id)
            if req is not None and req.status is not RequestStatus.FINISHED:
                out.append(self._fail_request(req, err.code, err.message, err.status))
        return out

    def fail_all(self, code: str, message: str, status: int = 503) -> list[RequestError]:
        """End every request with an error (the worker is gone); the engine is empty afterwards."""
        errors = [RequestError(request_id=rid, code=code, message=message, status=status) for rid in self.requests]
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            else:
                self.running.remove(req)
            self._finish(req, FinishReason.ERROR)
        self._inflight.clear()
        self._to_forget.clear()
        return errors

    # ------------------------------------------------------------------ stats and invariants

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_total_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free, num_cached_blocks=self.kv.num_cached,
            prefix_cache_queries_tokens=c.prefix_queries_tokens, prefix_cache_hits_tokens=c.prefix_hits_tokens,
            num_preemptions=c.preemptions, num_steps=self.num_steps)

    def check_invariants(self) -> None:
        """Block accounting is exact (tests): counts = tree + holders, free list = count 0, states consistent."""
        self.kv.check(self.running + list(self.waiting))
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and not req.block_ids and req.num_computed == 0, req
            assert req.state_slot == NO_STATE_SLOT, req
            assert not req.awaits_grammar or not req.num_output_tokens, req  # held: it never sampled
        bs = self.kv.block_size
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, req
            assert len(req.block_ids) >= blocks_needed(req.num_computed, bs), req
            assert (req.state_slot != NO_STATE_SLOT) == (self.kv.slots is not None), req
            # held at its last prompt token: never sampled, never computed that token
            assert not req.awaits_grammar or (not req.num_output_tokens and req.num_computed < req.num_tokens), req
        assert len(self.running) <= self.policy.max_running
        assert set(self.requests) == {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
