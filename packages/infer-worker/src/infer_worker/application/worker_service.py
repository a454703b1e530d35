"""Applies StepPlans to the worker's persistent batch and runs them: the worker's one use case."""

from __future__ import annotations

import time
from typing import Protocol

from infer_protocol.messages import NewSeq, StepPlan, StepResult

from infer_worker.domain.sequence import SampledTokens, ScheduledSeq, Sequence


class StepExecutor(Protocol):
    def execute(self, scheduled: list[ScheduledSeq]) -> SampledTokens: ...


class UnknownSequenceError(RuntimeError):
    """The plan referred to a sequence this worker does not hold (a protocol bug, never user input)."""


class WorkerService:
    """Keeps the persistent batch (seq_id -> Sequence) and turns each plan diff into one executed step."""

    def __init__(self, executor: StepExecutor) -> None:
        self._executor = executor
        self._seqs: dict[int, Sequence] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def step(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        for seq_id in plan.finished:
            self._seqs.pop(seq_id, None)
        for seq_id in plan.preempted:
            self._seqs.pop(seq_id, None)
        scheduled = [self._admit(new) for new in plan.new_seqs]
        scheduled += [self._continue(cont.seq_id, cont.num_tokens, cont.new_block_ids) for cont in plan.continuing]
        sampled = self._executor.execute(scheduled) if scheduled else SampledTokens([], [], [])
        for item in scheduled:
            item.seq.num_computed += item.num_new
        for seq_id, token_id in zip(sampled.seq_ids, sampled.token_ids):
            self._seqs[seq_id].token_ids.append(token_id)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        return StepResult(
            step=plan.step,
            seq_ids=sampled.seq_ids,
            token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            elapsed_ms=elapsed_ms,
            top_logprobs=sampled.top_logprobs,
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
