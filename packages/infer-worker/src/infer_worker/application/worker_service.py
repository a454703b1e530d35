"""Applies StepPlans to the worker's persistent batch and runs them: the worker's one use case.

`launch(plan)` applies the plan's diff and queues its step; `collect()` waits for the oldest queued step and
turns it into its StepResult. With the one-step-ahead pipeline the caller launches step k+1 before collecting
step k: each sequence that samples in a launched step gets a PENDING token, which the next step's input gathers
on the device, and which `collect()` replaces with the sampled id. `step(plan)` does both at once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple, Protocol

from infer_protocol.messages import NewSeq, StepPlan, StepResult

from infer_worker.domain.sequence import PENDING, SampledTokens, ScheduledSeq, Sequence


class LaunchedWork(Protocol):
    launch_id: int
    seqs: list[Sequence]

    def ready(self) -> bool: ...

    def result(self) -> SampledTokens: ...


class StepExecutor(Protocol):
    def launch(self, scheduled: list[ScheduledSeq]) -> LaunchedWork: ...


class UnknownSequenceError(RuntimeError):
    """The plan referred to a sequence this worker does not hold (a protocol bug, never user input)."""


class _InFlight(NamedTuple):
    step: int
    started: float  # perf_counter when the plan was taken
    launch_ms: float  # host time to apply the diff, prepare the inputs and queue the work
    work: LaunchedWork
    pending: list[tuple[Sequence, int]]  # (sequence, index of its PENDING token) per sampling row


class WorkerService:
    """Keeps the persistent batch (seq_id -> Sequence) and turns each plan diff into one launched step."""

    def __init__(self, executor: StepExecutor) -> None:
        self._executor = executor
        self._seqs: dict[int, Sequence] = {}
        self._inflight: deque[_InFlight] = deque()

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

    def launch(self, plan: StepPlan) -> list[StepResult]:
        """Apply the plan and queue its step. Returns the results of earlier steps that had to be collected first
        (a row that needs logits processing reads its whole history, so no token of it may be PENDING)."""
        started = time.perf_counter()
        for seq_id in plan.finished:
            self._seqs.pop(seq_id, None)
        for seq_id in plan.preempted:
            self._seqs.pop(seq_id, None)
        scheduled = [self._admit(new) for new in plan.new_seqs]
        scheduled += [self._continue(cont.seq_id, cont.num_tokens, cont.new_block_ids) for cont in plan.continuing]
        early: list[StepResult] = []
        if self._inflight and any(s.seq.needs_processing for s in scheduled):
            while self._inflight:
                early.append(self.collect())
        work = self._executor.launch(scheduled)
        for item in scheduled:
            item.seq.num_computed += item.num_new
        pending = []
        for row, seq in enumerate(work.seqs):
            seq.token_ids.append(PENDING)
            seq.sampled_at, seq.sampled_row = work.launch_id, row
            pending.append((seq, len(seq.token_ids) - 1))
        launch_ms = (time.perf_counter() - started) * 1e3
        self._inflight.append(_InFlight(plan.step, started, launch_ms, work, pending))
        return early

    @property
    def oldest_step(self) -> int:
        return self._inflight[0].step if self._inflight else -1

    def oldest_ready(self) -> bool:
        return bool(self._inflight) and self._inflight[0].work.ready()

    def collect(self) -> StepResult:
        """Wait for the oldest step in flight; write its sampled ids over their PENDING tokens."""
        sampled = self._inflight[0].work.result()
        flight = self._inflight.popleft()
        for (seq, index), token_id in zip(flight.pending, sampled.token_ids, strict=True):
            seq.token_ids[index] = token_id
        return StepResult(
            step=flight.step,
            seq_ids=sampled.seq_ids,
            token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            elapsed_ms=(time.perf_counter() - flight.started) * 1e3,
            top_logprobs=sampled.top_logprobs,
            launch_ms=flight.launch_ms,
            prompt_logprobs=sampled.prompt_logprobs,
        )

    def _admit(self, new: NewSeq) -> ScheduledSeq:
        seq = Sequence(
            seq_id=new.seq_id,
            token_ids=list(new.token_ids),
            num_computed=new.num_computed,
            block_ids=list(new.block_ids),
            sampling=new.sampling,
            prompt_len=len(new.token_ids) - new.num_generated,
            stop_token_ids=tuple(new.stop_token_ids),
        )
        self._seqs[new.seq_id] = seq
        return ScheduledSeq(seq, new.num_tokens)

    def _continue(self, seq_id: int, num_tokens: int, new_block_ids: list[int]) -> ScheduledSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"plan continues sequence {seq_id}, which the worker does not hold")
        seq.block_ids.extend(new_block_ids)
        return ScheduledSeq(seq, num_tokens)
