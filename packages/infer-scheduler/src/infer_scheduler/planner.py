"""Plans one step: which requests compute how many tokens, with which blocks (pure logic, no I/O).

The plan is a diff against the worker's persistent batch: `NewSeq` for a request the worker does not hold
(first admission, or re-admission after preemption: every known token, the cached prefix as num_computed),
`ContinueSeq` for one it holds (decode = 1 token, or the next prefill chunk). Each request's `num_computed`
advances when it is planned, so the tokens of the step in flight count as computed from then on.

A request whose grammar the worker is still compiling (`Request.awaits_grammar`) computes every prompt token but the
last and then sits out the steps (admitted, its blocks held) until the worker reports the grammar ready: its first
sample never waits for a compilation, and no other request waits for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from infer_protocol.messages import ContinueSeq, NewSeq

from infer_scheduler.kv_manager import KvCacheManager
from infer_scheduler.policy import FcfsPolicy
from infer_scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class Counters:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class Schedule:
    step: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    continuing: list[ContinueSeq] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # seq ids the worker must forget
    prefilling: list[Request] = field(default_factory=list)  # requests computing more than a decode
    prefill_ends: list[int] = field(default_factory=list)  # per prefilling request: its num_computed after this step
    decoding: list[Request] = field(default_factory=list)  # requests computing one token, in plan order
    num_tokens: int = 0
    # (request, index of its PENDING token, its preemption count) per sampling request, in the worker's order
    samplers: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.continuing)


class Planner:
    def __init__(self, policy: FcfsPolicy, kv: KvCacheManager, counters: Counters) -> None:
        self.policy = policy
        self.kv = kv
        self.counters = counters

    def schedule(self, step: int, running: list[Request], waiting: deque[Request]) -> Schedule:
        out = Schedule(step)
        prefills: list[Request] = []
        num_running = len(running)
        after_decodes = self._decodes(step, running, waiting, out, self.policy.max_batch_tokens, prefills)
        prefill_budget = self.policy.prefill_budget(len(out.decoding), after_decodes)
        # "decodes" counts a request in its decode phase that sits this step out (its token in flight): a long
        # chunk would stretch its next inter-token gap all the same
        chunk_cap = self.policy.chunk_cap(len(prefills) < num_running, len(out.decoding))
        budget = self._prefills(step, prefills, running, waiting, out, prefill_budget, chunk_cap)
        # After a preemption the blocks are too short to admit anyone (vLLM does the same) — unless the step is
        # empty (a lone request preempted itself): then it is re-admitted at once, from its cached pages.
        if not out.preempted or not out.continuing:
            budget = self._admit(step, running, waiting, out, budget, chunk_cap)
        out.num_tokens = self.policy.max_batch_tokens - after_decodes + prefill_budget - budget
        return out

    # ------------------------------------------------------------------ running requests

    def _decodes(self, step: int, running: list[Request], waiting: deque[Request], out: Schedule, budget: int,
                 prefills: list[Request]) -> int:
        """Schedule every running request in its decode phase (admission order); collect the part-way prefills.

        The hot loop of a decode-heavy step: one pass, no method calls unless a block is needed."""
        bs = self.kv.block_size
        grow = self.kv.grow
        cont = out.continuing
        add = cont.append
        decoding = out.decoding.append
        running_ = RequestStatus.RUNNING
        for req in tuple(running):  # a snapshot: victims leave `running` during the loop
            nc = req.num_computed
            if len(req.token_ids) - nc != 1:
                prefills.append(req)
                continue
            if req.awaits_grammar:
                continue  # held at its last prompt token until the worker's grammar is ready
            if req.status is not running_ or budget <= 0:
                continue  # preempted earlier in this step
            if nc + 1 >= req.max_len:
                continue  # the token a step in flight samples is its last (one-step-ahead pipeline)
            if req.reads_output and req.num_pending:
                continue  # its next sample reads the token still in flight: it waits a step, the batch does not
            if nc < len(req.block_ids) * bs:
                add(req.decode_msg)
            else:
                new = grow(req, 1)
                if new is None:
                    if not self._make_room(step, req, 1, running, waiting, out):
                        continue
                    new = grow(req, 1)
                    assert new is not None
                add(ContinueSeq(req.seq_id, 1, new))
            req.num_computed = nc + 1
            req.scheduled_step = step
            decoding(req)
            budget -= 1
        return budget

    def _prefills(self, step: int, prefills: list[Request], running: list[Request], waiting: deque[Request],
                  out: Schedule, budget: int, chunk_cap: int) -> int:
        kv, bs = self.kv, self.kv.block_size
        for req in prefills:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = self.policy.chunk(req, budget, chunk_cap)
            nc = req.num_computed
            if req.awaits_grammar:
                n = min(n, req.num_computable)  # (>= 1: a part-way prefill has two tokens left at least)
            while True:
                need = -(-(nc + n) // bs) - len(req.block_ids)
                if need <= 0 or need <= kv.num_available:
                    break
                fit = (len(req.block_ids) + kv.num_available) * bs - nc
                if fit > 0:  # shrink the chunk to the blocks there are rather than preempt
                    n = min(n, fit)
                    continue
                if not self._make_room(step, req, 1, running, waiting, out):
                    n = 0
                    break
            if n == 0:
                continue
            new = kv.grow(req, need) if need > 0 else []
            assert new is not None
            req.num_computed = nc + n
            req.scheduled_step = step
            out.continuing.append(ContinueSeq(req.seq_id, n, new))
            out.prefilling.append(req)
            out.prefill_ends.append(nc + n)
            budget -= n
        return budget

    def _make_room(self, step: int, req: Request, blocks: int, running: list[Request], waiting: deque[Request],
                   out: Schedule) -> bool:
        """Preempt victims until `blocks` blocks are available; False when `req` itself had to go."""
        while self.kv.num_available < blocks:
            victim = self.policy.pick_victim(running, step, req)
            self.preempt(victim, running, waiting, out)
            if victim is req:
                return False
        return True

    def preempt(self, victim: Request, running: list[Request], waiting: deque[Request], out: Schedule) -> None:
        """Drop a running request's blocks (its computed pages stay cached) and queue it for recompute."""
        self.kv.release(victim, keep_in_cache=True)
        victim.preempt()
        running.remove(victim)
        waiting.appendleft(victim)
        if victim.on_worker:
            out.preempted.append(victim.seq_id)
            victim.on_worker = False
        self.counters.preemptions += 1

    # ------------------------------------------------------------------ admission

    def _admit(self, step: int, running: list[Request], waiting: deque[Request], out: Schedule, budget: int,
               chunk_cap: int) -> int:
        kv, bs = self.kv, self.kv.block_size
        max_running = self.policy.max_running
        while waiting and budget > 0 and len(running) < max_running:
            req = waiting[0]
            if req.num_pending:
                break  # preempted while a step in flight samples its token: re-admit it once the token is known
            num_cached = 0 if req.prompt_lps is not None else kv.match(req)  # prompt logprobs: compute it all
            # (a request awaiting its grammar leaves its last token: it still computes one, kv.match saw to that)
            n = min(len(req.token_ids) - num_cached - req.awaits_grammar, chunk_cap, budget)
            need = -(-(num_cached + n) // bs) - len(req.block_ids)
            if need > kv.num_available or not kv.take_slot(req):
                kv.release(req, keep_in_cache=False)
                break
            kv.grow(req, need)
            waiting.popleft()
            req.admit()
            running.append(req)
            req.on_worker = True
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            c = self.counters
            c.prefix_queries_tokens += len(req.token_ids)
            c.prefix_hits_tokens += num_cached
            num_generated = req.num_output_tokens
            # min_tokens masking needs the ids it masks (only while it is still due: a preempted request may
            # be past it)
            # (and a grammar ends the output by allowing only them: the worker's matcher needs them too)
            masked = sorted(req.stop_token_ids) if (req.sampling.min_tokens > num_generated
                                                    or req.sampling.structured is not None) else []
            out.new_seqs.append(NewSeq(
                seq_id=req.seq_id, token_ids=list(req.token_ids), num_computed=num_cached, num_tokens=n,
                block_ids=list(req.block_ids), sampling=req.sampling, num_generated=num_generated,
                stop_token_ids=masked, state_slot=req.state_slot, images=req.images))
            req.num_computed = num_cached + n
            req.scheduled_step = step
            out.prefilling.append(req)
            out.prefill_ends.append(num_cached + n)
            budget -= n
        return budget
