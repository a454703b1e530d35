"""Applies StepPlans to the worker's persistent batch and runs them: the worker's one use case.

`launch(plan)` applies the plan's diff and queues its step; `collect()` waits for the oldest queued step and
turns it into its StepResult. With the one-step-ahead pipeline the caller launches step k+1 before collecting
step k: each sequence that samples in a launched step gets a PENDING token, which the next step's input gathers
on the device, and which `collect()` replaces with the sampled id. `step(plan)` does both at once.

Fault containment: an exception while a plan is applied, its step prepared or launched, or its tokens collected
fails that step alone unless the backend calls it fatal (`is_fatal`: a CUDA error leaves the device unusable;
then it propagates and the process ends). Every sequence of the failed step is forgotten and `collect()` returns
`StepFailed` in the step's place. The step after it may already be planned (and, for a failure at collection,
launched) with those sequences: they are left out of it here, and the scheduler drops them from it too; from
two steps after the failure on, plans name them only as finished.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

from infer_protocol.messages import GrammarStatus, NewSeq, SamplingParams, SeqError, StepFailed, StepPlan, StepResult

from infer_worker.application.block_table import BlockTable, ScheduledBatch
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.sampled_tokens import SampledTokens
from infer_worker.application.structured_output import GrammarBook, constrain
from infer_worker.domain.sequence import PENDING, Grammar, Sampling, ScheduledSeq, Sequence


class LaunchedWork(Protocol):
    launch_id: int
    seqs: list[Sequence]

    def ready(self) -> bool: ...

    def result(self) -> SampledTokens: ...


class StepExecutor(Protocol):
    def launch(self, scheduled: list[ScheduledSeq]) -> LaunchedWork: ...


log = logging.getLogger("rustinfer.worker")


def _never_fatal(exc: BaseException) -> bool:
    return False


_SAMPLING_FIELDS = Sampling.__dataclass_fields__.keys()


def to_sampling(params: SamplingParams) -> Sampling:
    """The domain's copy of a wire `SamplingParams`: made once per admitted sequence, never per step. It takes
    the fields the domain declares, so a wire field the worker does not know yet is not an error here."""
    fields = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    if params.structured is not None:  # a wire struct of its own: the domain's value type in its place
        fields["structured"] = Grammar(params.structured.kind, params.structured.schema)
    return Sampling(**fields)


class UnknownSequenceError(RuntimeError):
    """The plan referred to a sequence this worker does not hold (a protocol bug, never user input)."""


class _InFlight(NamedTuple):
    step: int
    started: float  # perf_counter when the plan was taken
    launch_ms: float  # host time to apply the diff, prepare the inputs and queue the work
    work: LaunchedWork | None  # None: the step failed (`failure` says why)
    pending: list[tuple[Sequence, int]]  # (sequence, index of its PENDING token) per sampling row
    failure: StepFailed | None = None
    seq_ids: tuple[int, ...] = ()  # every sequence of the step (what a failure at collection drops)


class WorkerService:
    """Keeps the persistent batch (seq_id -> Sequence, and their rows of the block table) and turns each plan
    diff into one launched step."""

    def __init__(self, executor: StepExecutor, is_fatal: Callable[[BaseException], bool] = _never_fatal,
                 grammars: GrammarBook | None = None, images: ImageInputs | None = None) -> None:
        self._executor = executor
        self._is_fatal = is_fatal
        self._grammars = grammars  # the executor's (it masks the rows): here sequences enter and leave it
        self._images = images  # the executor's too (None: no vision tower)
        self._seqs: dict[int, Sequence] = {}
        self._table = BlockTable()  # one row per live sequence; a diff writes only its new block ids
        self._inflight: deque[_InFlight] = deque()
        self._dropped: dict[int, int] = {}  # seq id -> the step that failed it (for the one step planned after it)
        self._no_grammar: list[SeqError] = []  # grammar rows admitted without a grammar engine, not reported yet

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def step(self, plan: StepPlan) -> StepResult:
        """Launch a step and wait for it (nothing else may be in flight)."""
        assert not self._inflight, "step() with steps in flight"
        self.launch(plan)
        return self.collect()

    def launch(self, plan: StepPlan) -> list[StepResult | StepFailed]:
        """Apply the plan and queue its step. Returns the results of earlier steps that had to be collected first
        (a row that needs logits processing reads its whole history, so no token of it may be PENDING)."""
        started = time.perf_counter()
        if self._dropped:
            # Plans from two steps after a failure name its sequences only as finished; a result still in flight
            # from the step after it must still leave them out.
            horizon = min([plan.step] + [f.step for f in self._inflight])
            self._dropped = {sid: step for sid, step in self._dropped.items() if horizon < step + 2}
        for seq_id in plan.finished:
            self._forget(seq_id)
        for seq_id in plan.preempted:
            self._forget(seq_id)
        early: list[StepResult | StepFailed] = []
        try:
            dropped = self._dropped
            scheduled = [self._admit(new) for new in plan.new_seqs if new.seq_id not in dropped]
            scheduled += [self._continue(cont.seq_id, cont.num_tokens, cont.new_block_ids)
                          for cont in plan.continuing if cont.seq_id not in dropped]
            # A row that reads its own output (penalties) needs it whole: collect until none of its tokens is
            # PENDING (the scheduler plans such a row only once its token is back, so this waits only in the
            # worker's own tests and the synchronous paths). A grammar row's matcher takes its PENDING token
            # from the launch in flight (ModelRunner._pending_token).
            while self._inflight and any(s.seq.reads_output and PENDING in s.seq.token_ids[-2:]
                                         for s in scheduled):
                early.append(self.collect())
            work = self._executor.launch(ScheduledBatch(scheduled, self._table))
        except Exception as exc:
            if self._is_fatal(exc):
                raise
            failure = self._fail(plan.step, self._plan_seq_ids(plan), exc)
            self._inflight.append(_InFlight(plan.step, started, 0.0, None, [], failure))
            return early
        for item in scheduled:
            item.seq.num_computed += item.num_new
        pending = []
        for row, seq in enumerate(work.seqs):
            seq.token_ids.append(PENDING)
            seq.sampled_at, seq.sampled_row = work.launch_id, row
            pending.append((seq, len(seq.token_ids) - 1))
        launch_ms = (time.perf_counter() - started) * 1e3
        self._inflight.append(_InFlight(plan.step, started, launch_ms, work, pending,
                                        seq_ids=tuple(item.seq.seq_id for item in scheduled)))
        return early

    def _plan_seq_ids(self, plan: StepPlan) -> list[int]:
        ids = [new.seq_id for new in plan.new_seqs] + [cont.seq_id for cont in plan.continuing]
        return [sid for sid in ids if sid not in self._dropped]

    def _fail(self, step: int, seq_ids: list[int], exc: BaseException) -> StepFailed:
        """Forget the step's sequences (whatever the failure left of them) and describe the failure in one line."""
        for sid in seq_ids:
            self._forget(sid)
            self._dropped[sid] = step
        first_line = (str(exc).strip().splitlines() or [""])[0]
        message = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        log.error("step %d failed, its %d sequences are dropped and the worker goes on: %s", step, len(seq_ids),
                  message)
        log.debug("%s", "".join(traceback.format_exception(exc)))
        return StepFailed(step=step, seq_ids=seq_ids, message=message)

    @property
    def oldest_step(self) -> int:
        return self._inflight[0].step if self._inflight else -1

    def oldest_ready(self) -> bool:
        if not self._inflight:
            return False
        work = self._inflight[0].work
        return work is None or work.ready()

    def collect(self) -> StepResult | StepFailed:
        """Wait for the oldest step in flight; write its sampled ids over their PENDING tokens."""
        flight = self._inflight[0]
        if flight.failure is not None or flight.work is None:
            self._inflight.popleft()
            assert flight.failure is not None
            return flight.failure
        try:
            sampled = flight.work.result()
        except Exception as exc:
            if self._is_fatal(exc):
                raise
            self._inflight.popleft()
            return self._fail(flight.step, list(flight.seq_ids), exc)
        self._inflight.popleft()
        for (seq, index), token_id in zip(flight.pending, sampled.token_ids, strict=True):
            seq.token_ids[index] = token_id
        seq_errors = list(getattr(flight.work, "seq_errors", None) or ())
        ready: list[int] = []
        if self.compiling:
            ready, failed = self._poll_grammars()
            seq_errors += failed
        result = StepResult(
            step=flight.step,
            seq_ids=sampled.seq_ids,
            token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            elapsed_ms=(time.perf_counter() - flight.started) * 1e3,
            top_logprobs=sampled.top_logprobs,
            launch_ms=flight.launch_ms,
            prompt_logprobs=sampled.prompt_logprobs,
            seq_errors=seq_errors,
            grammars_ready=ready,
        )
        return self._without_dropped(result) if self._dropped else result

    @property
    def compiling(self) -> bool:
        """A grammar's readiness is still to report (the worker loop polls `grammar_status` while no step runs)."""
        return bool(self._no_grammar) or (self._grammars is not None and self._grammars.compiling)

    def grammar_status(self) -> GrammarStatus | None:
        """The grammars that became ready or failed since the last report, when any did (sent unasked while no
        step is in flight: a constrained sequence held at its last prompt token may be all the scheduler has)."""
        if not self.compiling:
            return None
        ready, errors = self._poll_grammars()
        return GrammarStatus(ready=ready, errors=errors) if ready or errors else None

    def _poll_grammars(self) -> tuple[list[int], list[SeqError]]:
        ready, errors = self._grammars.poll() if self._grammars is not None else ([], [])
        if self._no_grammar:
            errors, self._no_grammar = self._no_grammar + errors, []
        return ready, errors

    def _without_dropped(self, result: StepResult) -> StepResult:
        """Leave out the rows of sequences an earlier step's failure dropped (launched before it was known)."""
        dropped = {sid for sid, step in self._dropped.items() if step < result.step}
        keep = [i for i, sid in enumerate(result.seq_ids) if sid not in dropped]
        if len(keep) == len(result.seq_ids) and not any(
                c.seq_id in dropped for c in [*result.prompt_logprobs, *result.seq_errors]) and not any(
                sid in dropped for sid in result.grammars_ready):
            return result

        def pick(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in keep]

        return StepResult(step=result.step, seq_ids=pick(result.seq_ids), token_ids=pick(result.token_ids),
                          logprobs=pick(result.logprobs), elapsed_ms=result.elapsed_ms,
                          top_logprobs=pick(result.top_logprobs), launch_ms=result.launch_ms,
                          prompt_logprobs=[c for c in result.prompt_logprobs if c.seq_id not in dropped],
                          seq_errors=[e for e in result.seq_errors if e.seq_id not in dropped],
                          grammars_ready=[sid for sid in result.grammars_ready if sid not in dropped])

    def _admit(self, new: NewSeq) -> ScheduledSeq:
        seq = Sequence(
            seq_id=new.seq_id,
            token_ids=list(new.token_ids),
            num_computed=new.num_computed,
            block_ids=list(new.block_ids),
            sampling=to_sampling(new.sampling),
            prompt_len=len(new.token_ids) - new.num_generated,
            stop_token_ids=tuple(new.stop_token_ids),
            state_slot=new.state_slot,  # (the runner zeroes it: the sequence starts at position 0)
        )
        self._forget(new.seq_id)  # (a plan re-admits a preempted sequence only after naming it preempted)
        if new.sampling.structured is not None:
            if self._grammars is not None:
                self._grammars.admit(seq)
            else:  # (never in a worker, which always has a book): the scheduler holds the row for a report
                constrain(seq)
                self._no_grammar.append(SeqError(new.seq_id, "structured_output_unavailable",
                                                 "this worker has no grammar engine", 500))
        if new.images:
            if self._images is None:
                raise ValueError(f"sequence {new.seq_id} has images, but this worker's model has no vision tower")
            self._images.admit(seq, new.images)
        self._seqs[new.seq_id] = seq
        self._table.add(seq)
        return ScheduledSeq(seq, new.num_tokens)

    def _continue(self, seq_id: int, num_tokens: int, new_block_ids: list[int]) -> ScheduledSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"plan continues sequence {seq_id}, which the worker does not hold")
        if new_block_ids:
            seq.block_ids.extend(new_block_ids)
            self._table.append(seq, new_block_ids)
        return ScheduledSeq(seq, num_tokens)

    def _forget(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._table.remove(seq)
        if self._grammars is not None:
            self._grammars.forget(seq_id)
        if self._images is not None:
            self._images.forget(seq_id)
