"""Scheduling policy: FCFS continuous batching, step budgets, chunk sizes and the preemption victim.

Order within a step: running requests in the decode phase first (one token each, in admission order), then
running requests part-way through their prefill (admission order), then waiting requests in arrival order
(a preempted request goes back to the head of the queue, since it arrived before everything still waiting).
Admission is head-of-line: if the head of the queue does not fit, nobody behind it jumps ahead.

The running set is capped at min(max_batch_seqs, max_batch_tokens), so every running decode fits in every
step: decodes are never starved, whatever the prompts waiting behind them. While anything decodes, a step's
prompt tokens are capped too (`prefill_tokens_while_decoding`), which bounds how much one step, and so each
running stream's inter-token latency, grows when a long prompt arrives. While nothing decodes, one request's
chunk may take the whole step budget (`idle_prefill_uses_step_budget`): no stream waits on that step.

Graph-sized steps: the worker replays CUDA graphs for mixed steps of its token buckets (`Ready.graph_step_tokens`,
e.g. 64 ... 2048) and pads a step to the next bucket up, or runs it eagerly past the largest. While anything
decodes, the decodes and a capped chunk would spill just past a bucket (10 decodes + a 512-token cap = 522 tokens,
padded to 1,024: twice the work; + a 2,048-token chunk: eager), so the step's prompt tokens are trimmed to end at
the bucket below (`fit_to_graph`) when that keeps at least half of them; the trimmed tokens go in the next step.

Preemption victim (by recompute): the most recently admitted running request that has not been scheduled yet
in this step (LIFO, as vLLM). Decodes are scheduled first, so part-way prefills (the cheapest work to redo)
go first; a request that finds nobody left to preempt preempts itself. The oldest requests therefore always
make progress, and since a lone request always fits the cache (larger ones are refused at submission),
every admitted request finishes.
"""

from __future__ import annotations

from infer_scheduler.request import Request, RequestStatus


class FcfsPolicy:
    def __init__(self, max_batch_tokens: int, max_batch_seqs: int, chunked_prefill_size: int,
                 prefill_tokens_while_decoding: int = 0, idle_prefill_uses_step_budget: bool = False,
                 graph_step_tokens: tuple[int, ...] = ()) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.chunk_size = chunked_prefill_size
        # With nothing decoding no stream waits on the step, so a chunk only costs its own prompt's TTFT: the
        # fewer, larger steps of a lone long prompt save each step's fixed cost (a 16k prompt: 2 steps, not 8).
        self.idle_chunk_size = max(max_batch_tokens, chunked_prefill_size) if idle_prefill_uses_step_budget \
            else chunked_prefill_size
        self.max_running = min(max_batch_seqs, max_batch_tokens)
        self.prefill_tokens_while_decoding = prefill_tokens_while_decoding
        self.graph_step_tokens = tuple(sorted(set(graph_step_tokens), reverse=True))  # largest first

    def prefill_budget(self, num_decodes: int, budget_left: int) -> int:
        """Prompt tokens this step may carry once its decodes are planned (Sarathi-Serve's stall-free batching):
        while anything decodes, at most `prefill_tokens_while_decoding` (0 = no cap), so that a long prompt is
        spread over several steps instead of stretching one decode step by its whole chunk, fitted to a graph bucket
        beside the decodes (`fit_to_graph`); with nothing decoding, the whole step budget."""
        cap = self.prefill_tokens_while_decoding
        if not num_decodes:
            return budget_left
        return self.fit_to_graph(num_decodes, min(budget_left, cap) if cap > 0 else budget_left)

    def chunk_cap(self, anything_decodes: bool, num_decodes: int = 0) -> int:
        """One request's prompt tokens a step may carry: `chunked_prefill_size` (fitted to a graph bucket beside
        the step's `num_decodes`), or with nothing decoding (and `idle_prefill_uses_step_budget`) the whole step
        budget."""
        return self.fit_to_graph(num_decodes, self.chunk_size) if anything_decodes else self.idle_chunk_size

    def fit_to_graph(self, num_decodes: int, prompt_tokens: int) -> int:
        """At most `prompt_tokens` beside `num_decodes` decodes, trimmed so that the step ends at the largest graph
        bucket it would pass, if that keeps at least half of them (module docstring); else `prompt_tokens`."""
        total = num_decodes + prompt_tokens
        for bucket in self.graph_step_tokens:
            if bucket <= total:  # the largest bucket the step reaches: it ends there already, or trims to it
                fitted = bucket - num_decodes
                return fitted if 2 * fitted >= prompt_tokens else prompt_tokens
        return prompt_tokens

    def chunk(self, req: Request, token_budget: int, cap: int) -> int:
        """Tokens this request computes now: what it has left, capped by `cap` (`chunk_cap`) and the budget."""
        n = len(req.token_ids) - req.num_computed
        if n > cap:
            n = cap
        return n if n <= token_budget else token_budget

    def pick_victim(self, running: list[Request], step: int, requester: Request) -> Request:
        """The most recently admitted running request not yet scheduled in `step`, else the requester."""
        for r in reversed(running):
            if r is not requester and r.scheduled_step != step and r.status is RequestStatus.RUNNING:
                return r
        return requester
