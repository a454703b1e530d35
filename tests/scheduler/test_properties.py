"""Property-based: random interleavings of submit / step / abort (also mid-step) / evict on a tiny cache.

After every operation: no block leaked or double-freed (every reference count equals tree + holders, the free
list is exactly the count-0 blocks) and free + cached + in-use == total; with state slots (a hybrid model) every
running request holds exactly one, no two the same, and free + held == total. At the end every accepted request
has finished (or was aborted) and every block and slot is free (or the block cached).

Some requests carry a grammar: held at their last prompt token until the simulated worker reports it compiled (after
a random number of steps, in a result, or at any moment as the worker's unsolicited GrammarStatus), or failed (a
bad grammar ends that request alone); the worker checks that none samples before its report.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infer_scheduler.engine import Engine

import msgspec

from infer_protocol.messages import RequestError, StructuredOutput

from .conftest import make_submit
from .sim_worker import BAD_GRAMMAR, SimWorker, run_to_completion


def with_grammar(sub, grammar: str | None):
    """`sub` constrained by a grammar ("ok": one that compiles, "bad": one that fails), or as it is (None)."""
    if grammar is None:
        return sub
    schema = BAD_GRAMMAR if grammar == "bad" else "[0-9]+"
    sampling = msgspec.structs.replace(sub.sampling, structured=StructuredOutput("regex", schema))
    return msgspec.structs.replace(sub, sampling=sampling)

STOP = 3


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]), max_batch_tokens=st.integers(1, 32),
        max_batch_seqs=st.integers(1, 8), chunk=st.integers(1, 16), prefix_caching=st.booleans(),
        seed=st.integers(0, 2**16), overlap=st.booleans(), prefill_cap=st.integers(0, 6),
        state_slots=st.sampled_from([0, 0, 1, 2, 3]), grammar_steps=st.integers(0, 6), idle_chunks=st.booleans(),
        graph_tokens=st.sampled_from([(), (), (2, 4, 8), (1, 3, 16)]),
    )
    def setup(self, num_blocks, block_size, max_batch_tokens, max_batch_seqs, chunk, prefix_caching, seed,
              overlap, prefill_cap, state_slots, grammar_steps, idle_chunks, graph_tokens):
        self.engine = Engine(num_blocks=num_blocks, block_size=block_size, max_model_len=48,
                             max_batch_tokens=max_batch_tokens, max_batch_seqs=max_batch_seqs,
                             chunked_prefill_size=chunk, enable_prefix_caching=prefix_caching,
                             prefill_tokens_while_decoding=prefill_cap, max_inflight_steps=2 if overlap else 1,
                             num_state_slots=state_slots, idle_prefill_uses_step_budget=idle_chunks,
                             graph_step_tokens=graph_tokens)
        self.worker = SimWorker(num_blocks, block_size, vocab_size=8, rng=random.Random(seed),
                                num_state_slots=state_slots, grammar_steps=grammar_steps)
        self.held: deque = deque()  # results the worker computed that the engine has not seen yet
        self.prefixes = [[5, 6, 7, 4, 5, 6, 7, 4], [4, 4, 5, 5, 6, 6, 7, 7]]
        self.accepted: set[str] = set()
        self.ended: dict[str, str] = {}
        self.n = 0

    def _collect(self, outs) -> None:
        for o in outs:
            assert o.request_id in self.accepted and o.request_id not in self.ended, o
            if isinstance(o, RequestError):
                assert o.code == "invalid_grammar" and o.status == 400, o
                self.ended[o.request_id] = "error"
            elif o.finish_reason is not None:
                self.ended[o.request_id] = o.finish_reason

    @rule(prefix=st.integers(0, 2), plen=st.integers(0, 8), tail=st.lists(st.integers(1, 7), max_size=10),
          max_tokens=st.integers(1, 16), stop=st.booleans(), min_tokens=st.integers(0, 3),
          grammar=st.sampled_from([None, None, "ok", "bad"]))
    def submit(self, prefix, plen, tail, max_tokens, stop, min_tokens, grammar):
        prompt = (self.prefixes[prefix][:plen] if prefix < 2 else []) + tail
        self.n += 1
        rid = f"h{self.n}"
        err = self.engine.submit(with_grammar(make_submit(prompt, max_tokens=max_tokens, rid=rid,
                                                          stop_token_ids=[STOP] if stop else [],
                                                          min_tokens=min_tokens), grammar))
        if err is None:
            self.accepted.add(rid)
        else:
            assert err.code in ("invalid_request", "context_length_exceeded") and err.message

    @rule()
    def launch(self):
        """Plan a step (when the pipeline depth allows) and let the worker compute it; its result is held."""
        if self.engine.can_plan:
            plan = self.engine.plan_step()
            if plan is not None:
                self.held.append(self.worker.step(plan))

    @precondition(lambda self: bool(self.held))
    @rule()
    def deliver(self):
        result = self.held.popleft()
        self._collect(self.engine.fail_sequences(result.seq_errors))  # (the service's order)
        self._collect(self.engine.apply_result(result))

    @rule()
    def grammar_status(self):
        """The worker's unsolicited report (sent while it idles; here at any moment): every compilation ends."""
        status = self.worker.idle_status()
        if status is not None:
            self.engine.grammars_ready(status.ready)
            self._collect(self.engine.fail_sequences(status.errors))

    @precondition(lambda self: bool(self.engine.requests))
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick):
        live = sorted(self.engine.requests)
        out = self.engine.abort(live[pick % len(live)])
        self._collect([out])

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        cache = self.engine.kv.cache
        if cache is not None:
            free_before, evictable = self.engine.kv.num_free, cache.num_evictable_blocks
            freed = cache.evict(n)
            assert freed >= min(n, evictable)
            assert self.engine.kv.num_free == free_before + freed

    @invariant()
    def blocks_are_exactly_accounted(self):
        e = self.engine
        e.check_invariants()
        refs = e.kv.allocator.refcounts()
        cached = set(e.kv.cache.cached_blocks()) if e.kv.cache is not None else set()
        in_use = sum(1 for b in np.flatnonzero(refs > 0).tolist() if b not in cached)
        assert e.kv.num_free + len(cached) + in_use == e.kv.num_blocks
        st_ = e.stats()
        assert st_.num_free_blocks + st_.num_cached_blocks <= st_.num_total_blocks
        if e.kv.slots is not None:
            assert e.kv.cache is None  # prefix caching is off with state slots
            held = [r.state_slot for r in e.running]
            assert 0 not in held and len(set(held)) == len(held)
            assert e.kv.slots.num_free + len(held) == e.kv.slots.num_slots

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        e = self.engine
        self._collect([o for outs in run_to_completion(e, self.worker, max_steps=5000, held=self.held).values() for o in outs])
        assert set(self.ended) == self.accepted, self.accepted - set(self.ended)
        assert not e.requests and not e.running and not e.waiting
        assert e.kv.num_free + e.kv.num_cached == e.kv.num_blocks
        assert e.kv.slots is None or e.kv.slots.num_free == e.kv.slots.num_slots
        e.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerProperties = SchedulerMachine.TestCase


def _serve(subs, arrivals, grammar_steps: int = 0, **kw) -> tuple[dict[str, list[int]], Engine]:
    e = Engine(max_model_len=64, **kw)
    # the deterministic "greedy model"
    w = SimWorker(kw["num_blocks"], kw["block_size"], vocab_size=8, num_state_slots=kw.get("num_state_slots", 0),
                  grammar_steps=grammar_steps)
    toks: dict[str, list[int]] = {}
    pending = sorted(zip(arrivals, range(len(subs)), strict=True))
    step = 0
    held: deque = deque()
    while pending or e.has_work or held:
        while pending and pending[0][0] <= step:
            assert e.submit(subs[pending.pop(0)[1]]) is None
        while e.can_plan and (plan := e.plan_step()) is not None:
            held.append(w.step(plan))
        if held:
            for o in e.apply_result(held.popleft()):
                toks.setdefault(o.request_id, []).extend(o.token_ids)
        elif (status := w.idle_status()) is not None:  # grammars compiled while the worker idled
            e.grammars_ready(status.ready)
        step += 1
        assert step < 5000
    e.check_invariants()
    return toks, e


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(1, 7), min_size=1, max_size=8),
                            st.integers(1, 10), st.integers(0, 6), st.booleans()), min_size=1, max_size=10),
    block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 6), chunk=st.integers(1, 8),
    max_batch_tokens=st.integers(2, 24), prefix_caching=st.booleans(), overlap=st.booleans(),
    state_slots=st.sampled_from([0, 0, 1, 2, 3]), grammar_steps=st.integers(0, 4), idle_chunks=st.booleans(),
)
def test_outputs_do_not_depend_on_caching_chunking_preemption_or_overlap(reqs, block_size, spare, chunk,
                                                                         max_batch_tokens, prefix_caching, overlap,
                                                                         state_slots, grammar_steps, idle_chunks):
    """(state_slots: a hybrid model's, few enough that they, not the blocks, often bound the running set; some
    requests carry a grammar, held until the worker reports it compiled, `grammar_steps` after admission)"""
    shared = [5, 6, 7, 4, 5, 6, 7, 4, 6, 6, 5, 5]
    subs = [with_grammar(make_submit(shared[:p] + tail, max_tokens=m, rid=f"e{i}"), "ok" if g else None)
            for i, (p, tail, m, _, g) in enumerate(reqs)]
    arrivals = [a for *_, a, _ in reqs]
    # the smallest cache that holds the largest request alone, plus a little: preemption is the norm
    need = max(-(-(len(s.prompt_token_ids) + s.max_tokens - 1) // block_size) for s in subs)
    ref, _ = _serve(subs, arrivals, num_blocks=512, block_size=block_size, enable_prefix_caching=False)
    got, e = _serve(subs, arrivals, num_blocks=need + spare, block_size=block_size, chunked_prefill_size=chunk,
                    max_batch_tokens=max_batch_tokens, enable_prefix_caching=prefix_caching,
                    max_inflight_steps=2 if overlap else 1, num_state_slots=state_slots, grammar_steps=grammar_steps,
                    idle_prefill_uses_step_budget=idle_chunks)
    assert got == ref
    assert all(len(ref[s.request_id]) == s.max_tokens for s in subs)
