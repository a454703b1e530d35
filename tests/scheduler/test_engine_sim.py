"""The engine against the simulated worker: exact plan contents, prefix-cache reuse, and output equivalence."""

from __future__ import annotations

import random

import pytest

from infer_protocol.messages import ContinueSeq, NewSeq, StepPlan

from .conftest import make_engine, make_submit
from .sim_worker import SimWorker, run_to_completion, tokens_of


def test_exact_plans_for_one_request():
    e = make_engine(num_blocks=16, block_size=4, chunked_prefill_size=4, enable_prefix_caching=False)
    w = SimWorker(16, 4)
    e.submit(make_submit([11, 12, 13, 14, 15, 16], max_tokens=4, rid="a"))
    p1 = e.plan_step()
    assert isinstance(p1, StepPlan) and p1.step == 1 and p1.continuing == [] and p1.finished == []
    assert p1.new_seqs == [NewSeq(seq_id=1, token_ids=[11, 12, 13, 14, 15, 16], num_computed=0, num_tokens=4,
                                  block_ids=[0], sampling=p1.new_seqs[0].sampling, num_generated=0)]
    r1 = w.step(p1)
    assert r1.seq_ids == [] and e.apply_result(r1) == []
    p2 = e.plan_step()  # the rest of the prompt: 2 tokens, one more block, samples the first token
    assert p2.new_seqs == [] and p2.continuing == [ContinueSeq(1, 2, [1])]
    (o2,) = e.apply_result(w.step(p2))
    assert o2.num_prompt_tokens == 6 and o2.num_cached_tokens == 0 and o2.finish_reason is None
    p3 = e.plan_step()  # decode of position 6 (block 1 still has room)
    assert p3.continuing == [ContinueSeq(1, 1, [])]
    e.apply_result(w.step(p3))
    p4 = e.plan_step()  # position 7: last slot of block 1
    assert p4.continuing == [ContinueSeq(1, 1, [])]
    e.apply_result(w.step(p4))
    p5 = e.plan_step()  # position 8: a new block
    assert p5.continuing == [ContinueSeq(1, 1, [2])]
    (o5,) = e.apply_result(w.step(p5))
    assert o5.finish_reason == "length"
    assert e.plan_step() is None  # nothing to run: the forget list waits for the next real step
    e.submit(make_submit([1, 2], max_tokens=1, rid="b"))
    p6 = e.plan_step()
    assert p6.finished == [1] and p6.new_seqs[0].seq_id == 2
    assert e.stats().num_free_blocks == 16 - 1


def test_shared_prefix_is_served_from_cache():
    bs = 4
    e = make_engine(num_blocks=64, block_size=bs)
    w = SimWorker(64, bs)
    system = list(range(100, 130))  # 30 shared tokens: 7 full pages = 28 tokens
    e.submit(make_submit(system + [1, 2, 3], max_tokens=5, rid="first"))
    out1 = run_to_completion(e, w)
    assert out1["first"][0].num_cached_tokens == 0
    before = e.stats()
    computed_before = w.tokens_computed
    e.submit(make_submit(system + [7, 8, 9, 10], max_tokens=5, rid="second"))
    plan = e.plan_step()
    (ns,) = plan.new_seqs
    assert ns.num_computed == 28 and ns.num_tokens == 34 - 28
    first_blocks = [b for p in w.plans for n in p.new_seqs if n.seq_id == 1 for b in n.block_ids]
    assert ns.block_ids[:7] == first_blocks[:7]  # the very same blocks, shared
    e.apply_result(w.step(plan))
    out2 = run_to_completion(e, w)
    after = e.stats()
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 28
    assert after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens == 34
    assert len(tokens_of(out2["second"])) == 4  # the first token came with the prefill step
    assert w.tokens_computed - computed_before == 6 + 4  # prefill shrank to 6 tokens, then 4 decodes
    # the whole conversation, extended (multi-turn): cached up to what was computed, page aligned
    turn2 = system + [1, 2, 3] + tokens_of(out1["first"]) + [42]
    e.submit(make_submit(turn2, max_tokens=1, rid="turn2"))
    ns = e.plan_step().new_seqs[0]
    assert ns.num_computed == (len(turn2) - 2) // bs * bs  # the last generated token was never computed


def _workload(n: int, seed: int) -> list:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(24)]
    subs = []
    for i in range(n):
        prompt = (shared[: rng.randrange(0, 24)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))])
        subs.append(make_submit(prompt, max_tokens=rng.randrange(1, 24), rid=f"q{i}"))
    return subs


def _serve(subs, **kw) -> tuple[dict[str, list[int]], object]:
    num_blocks = kw.pop("num_blocks", 512)
    bs = kw.pop("block_size", 4)
    e = make_engine(num_blocks=num_blocks, block_size=bs, max_model_len=128, **kw)
    w = SimWorker(num_blocks, bs)
    outs: dict[str, list] = {}
    for s in subs:  # one arrival per step: later requests find earlier prefixes cached
        assert e.submit(s) is None
        plan = e.plan_step()
        for o in e.apply_result(w.step(plan)):
            outs.setdefault(o.request_id, []).append(o)
        e.check_invariants()
    for rid, o in run_to_completion(e, w).items():
        outs.setdefault(rid, []).extend(o)
    assert e.kv.num_free + e.kv.num_cached == num_blocks  # nothing leaked
    return {rid: tokens_of(o) for rid, o in outs.items()}, e.stats()


@pytest.mark.parametrize("seed", [0, 1])
def test_same_tokens_with_caching_chunking_and_preemption(seed):
    subs = _workload(16, seed)
    base, _ = _serve(subs, enable_prefix_caching=False, chunked_prefill_size=4096)
    cached, st = _serve(subs, enable_prefix_caching=True)
    assert st.prefix_cache_hits_tokens > 0
    chunked, _ = _serve(subs, chunked_prefill_size=3, max_batch_tokens=16)
    tiny, st_tiny = _serve(subs, num_blocks=20, block_size=4)  # 80 slots for 16 requests
    assert st_tiny.num_preemptions > 0
    tiny_nocache, st2 = _serve(subs, num_blocks=20, block_size=4, enable_prefix_caching=False)
    assert st2.num_preemptions > 0
    assert base == cached == chunked == tiny == tiny_nocache
    assert all(len(t) == s.max_tokens for s in subs for t in [base[s.request_id]])


@pytest.mark.parametrize(("kw", "message"), [({"max_model_len": 1}, "max_model_len must be > 1"),
                                             ({"max_inflight_steps": 3}, "max_inflight_steps must be 1 or 2")])
def test_engine_refuses_a_bad_geometry(kw, message):
    with pytest.raises(ValueError, match=message):
        make_engine(**kw)
