"""Scheduling policy: FCFS continuous batching, step budgets, chunk sizes and the preemption victim.

Order within a step: running requests in the decode phase first (one token each, in admission order), then
running requests part-way through their prefill (admission order), then waiting requests in arrival order
(a preempted request goes back to the head of the queue, since it arrived before everything still waiting).
Admission is head-of-line: if the head of the queue does not fit, nobody behind it jumps ahead.

The running set is capped at min(max_batch_seqs, max_batch_tokens), so every running decode fits in every
step: decodes are never starved, whatever the prompts waiting behind them.

Preemption victim (by recompute): the most recently admitted running request that has not been scheduled yet
in this step (LIFO, as vLLM). Decodes are scheduled first, so part-way prefills (the cheapest work to redo)
go first; a request that finds nobody left to preempt preempts itself. The oldest requests therefore always
make progress, and since a lone request always fits the cache (larger ones are refused at submission),
every admitted request finishes.
"""

from __future__ import annotations

from infer_scheduler.request import Request, RequestStatus


class FcfsPolicy:
    def __init__(self, max_batch_tokens: int, max_batch_seqs: int, chunked_prefill_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.chunk_size = chunked_prefill_size
        self.max_running = min(max_batch_seqs, max_batch_tokens)

    def chunk(self, req: Request, token_budget: int) -> int:
        """Tokens this request computes now: what it has left, capped by the chunk size and the step budget."""
        n = len(req.token_ids) - req.num_computed
        if n > self.chunk_size:
            n = self.chunk_size
        return n if n <= token_budget else token_budget

    def pick_victim(self, running: list[Request], step: int, requester: Request) -> Request:
        """The most recently admitted running request not yet scheduled in `step`, else the requester."""
        for r in reversed(running):
            if r is not requester and r.scheduled_step != step and r.status is RequestStatus.RUNNING:
                return r
        return requester
