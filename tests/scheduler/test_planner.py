"""Planner decisions: budgets, caps, decode priority, prefix hits, preemption victim, refusals, stop rules."""

from __future__ import annotations

from collections import deque

import msgspec
import pytest

from infer_protocol.messages import StepResult
from infer_scheduler.engine import ResultMismatch

from .conftest import make_engine, make_submit
from .sim_worker import SimWorker, run_to_completion, tokens_of


def sampled(plan, token: int = 7) -> StepResult:
    """A result for `plan` where every sequence that reaches its end samples `token`."""
    ids = [ns.seq_id for ns in plan.new_seqs if ns.num_computed + ns.num_tokens == len(ns.token_ids)]
    ids += [c.seq_id for c in plan.continuing if c.num_tokens == 1]  # decodes (tests below keep chunks > 1)
    return StepResult(step=plan.step, seq_ids=ids, token_ids=[token] * len(ids))


def step_sizes(e, w: SimWorker) -> list[int]:
    """Plan a step, let the simulated worker run it; the tokens each of its sequences computes, sorted."""
    plan = e.plan_step()
    e.apply_result(w.step(plan))
    return sorted([c.num_tokens for c in plan.continuing] + [n.num_tokens for n in plan.new_seqs])


def test_token_budget_splits_the_last_admission_into_a_chunk():
    e = make_engine(max_batch_tokens=16, chunked_prefill_size=100)
    for i in range(3):
        e.submit(make_submit(list(range(100 * i + 1, 100 * i + 11))))  # distinct prompts: no prefix hits
    plan = e.plan_step()
    assert [(ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(0, 10), (0, 6)]
    assert len(e.waiting) == 1
    e.apply_result(sampled(plan))
    plan = e.plan_step()  # decode of #1 first, the rest of #2, then #3 with what is left
    assert [(c.num_tokens) for c in plan.continuing] == [1, 4]
    assert [(ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(0, 10)]
    assert sum(c.num_tokens for c in plan.continuing) + sum(n.num_tokens for n in plan.new_seqs) == 15


def test_prefill_cap_while_decoding_spreads_a_long_prompt_and_lifts_when_nothing_decodes():
    """With one request decoding, a 40-token prompt arrives: each step carries the decode and at most 8 prompt
    tokens (not the 32 the step budget would give). Alone, the same prompt takes the whole budget at once."""
    e = make_engine(num_blocks=256, max_batch_tokens=33, chunked_prefill_size=64, prefill_tokens_while_decoding=8)
    w = SimWorker(256, 4)
    e.submit(make_submit([1, 2, 3], max_tokens=20))
    e.apply_result(w.step(e.plan_step()))
    e.submit(make_submit(list(range(100, 140)), max_tokens=2))
    assert [step_sizes(e, w) for _ in range(5)] == [[1, 8], [1, 8], [1, 8], [1, 8], [1, 8]]

    alone = make_engine(num_blocks=256, max_batch_tokens=33, chunked_prefill_size=64, prefill_tokens_while_decoding=8)
    alone.submit(make_submit(list(range(100, 140)), max_tokens=2))
    assert [n.num_tokens for n in alone.plan_step().new_seqs] == [33]


def test_capped_chunks_beside_decodes_end_at_a_graph_bucket():
    """Three requests decode while a 40-token prompt arrives; the worker's mixed graphs hold 8, 16 and 32 tokens.
    With a cap of 16 prompt tokens a step, 3 decodes + 16 would be padded to 32: the chunks are trimmed to 13, so
    that every step is exactly 16 tokens. Without graphs the cap's 16 stand."""
    def steps_of(graph_tokens: tuple[int, ...]) -> list[list[int]]:
        e = make_engine(num_blocks=256, max_batch_tokens=64, chunked_prefill_size=64, prefill_tokens_while_decoding=16,
                        graph_step_tokens=graph_tokens)
        w = SimWorker(256, 4)
        for i in range(3):
            e.submit(make_submit([10 * i + 1, 10 * i + 2], max_tokens=30))
        e.apply_result(w.step(e.plan_step()))
        e.submit(make_submit(list(range(100, 140)), max_tokens=2))
        return [step_sizes(e, w) for _ in range(4)]

    assert steps_of((8, 16, 32)) == [[1, 1, 1, 13], [1, 1, 1, 13], [1, 1, 1, 13], [1, 1, 1, 1]]
    assert steps_of(()) == [[1, 1, 1, 16], [1, 1, 1, 16], [1, 1, 1, 8], [1, 1, 1, 1]]


def test_a_chunk_that_would_push_a_step_past_the_largest_graph_is_trimmed_to_it():
    """chunked_prefill_size 32 beside 2 decodes would make 34 tokens, past the largest graph (32): eager. The chunk
    is trimmed to 30. A trim that would drop more than half the chunk is not made (1 bucket of 8 beside 2 decodes:
    chunks of 32 stay), and with nothing decoding the chunk is not fitted."""
    def first_chunks(graph_tokens: tuple[int, ...], decoding: int) -> list[int]:
        e = make_engine(num_blocks=256, max_batch_tokens=128, chunked_prefill_size=32, graph_step_tokens=graph_tokens)
        w = SimWorker(256, 4)
        for i in range(decoding):
            e.submit(make_submit([10 * i + 1, 10 * i + 2], max_tokens=30))
        if decoding:
            e.apply_result(w.step(e.plan_step()))
        e.submit(make_submit(list(range(100, 170)), max_tokens=2))
        plan = e.plan_step()
        return [n.num_tokens for n in plan.new_seqs] + [c.num_tokens for c in plan.continuing if c.num_tokens > 1]

    assert first_chunks((8, 16, 32), decoding=2) == [30]
    assert first_chunks((8,), decoding=2) == [32]
    assert first_chunks((8, 16, 32), decoding=0) == [32]
    assert first_chunks((), decoding=2) == [32]


def test_a_lone_prompt_takes_the_whole_step_budget_only_while_nothing_decodes():
    """With `idle_prefill_uses_step_budget`, a 40-token prompt alone is prefilled in chunks of the step budget (33,
    not the chunk size 8); a second prompt arriving while the first decodes gets chunks of 8 again, and so does a
    part-way prefill once a decode runs beside it. Without the option chunks stay at 8 throughout (the two prompts
    prefill side by side, nothing decoding, until the first one's fifth chunk)."""
    def chunks_of(idle: bool) -> list[list[int]]:
        e = make_engine(num_blocks=256, max_batch_tokens=33, chunked_prefill_size=8,
                        idle_prefill_uses_step_budget=idle)
        w = SimWorker(256, 4)
        e.submit(make_submit(list(range(100, 140)), max_tokens=20, rid="first"))
        out = []
        for i in range(7):
            if i == 2:  # the first prompt's last chunk is done: it decodes from now on
                e.submit(make_submit(list(range(200, 230)), max_tokens=2, rid="second"))
            out.append(step_sizes(e, w))
        return out

    assert chunks_of(True) == [[33], [7], [1, 8], [1, 8], [1, 8], [1, 6], [1, 1]]
    assert chunks_of(False) == [[8], [8], [8, 8], [8, 8], [8, 8], [1, 6], [1, 1]]


def test_sequence_cap():
    e = make_engine(max_batch_seqs=2)
    for _ in range(4):
        e.submit(make_submit([1, 2, 3]))
    plan = e.plan_step()
    assert len(plan.new_seqs) == 2 and len(e.waiting) == 2


def test_chunked_prefill_progression():
    e = make_engine(chunked_prefill_size=4)
    e.submit(make_submit(list(range(1, 11)), max_tokens=2))
    w = SimWorker(64, 4)
    chunks, outs = [], []
    while (plan := e.plan_step()) is not None:
        chunks += [ns.num_tokens for ns in plan.new_seqs] + [c.num_tokens for c in plan.continuing]
        outs += e.apply_result(w.step(plan))
    assert chunks == [4, 4, 2, 1]  # three prompt chunks (the last one samples), then one decode
    assert [len(o.token_ids) for o in outs] == [1, 1] and outs[-1].finish_reason == "length"


def test_decodes_come_first_and_are_never_starved():
    e = make_engine(num_blocks=256, max_batch_tokens=8, chunked_prefill_size=8)
    w = SimWorker(256, 4)
    e.submit(make_submit([1, 2, 3], max_tokens=50))
    e.submit(make_submit([4, 5, 6], max_tokens=50))
    e.apply_result(w.step(e.plan_step()))
    e.submit(make_submit(list(range(100, 160)), max_tokens=1))  # a long prompt arrives
    for _ in range(7):
        plan = e.plan_step()
        assert [c.num_tokens for c in plan.continuing[:2]] == [1, 1]  # both decodes, first
        assert plan.continuing[0].seq_id == 1 and plan.continuing[1].seq_id == 2
        total = sum(c.num_tokens for c in plan.continuing) + sum(n.num_tokens for n in plan.new_seqs)
        assert total == 8  # the prompt gets the rest of the budget
        e.apply_result(w.step(plan))


def test_full_prompt_hit_still_computes_the_last_token():
    e = make_engine(block_size=4)
    w = SimWorker(64, 4)
    prompt = list(range(1, 9))  # exactly 2 pages
    e.submit(make_submit(prompt, max_tokens=1))
    run_to_completion(e, w)
    e.submit(make_submit(prompt, max_tokens=1))
    plan = e.plan_step()
    ns = plan.new_seqs[0]
    assert (ns.num_computed, ns.num_tokens) == (4, 4)  # the last page is recomputed for its logits
    assert e.stats().prefix_cache_hits_tokens == 4


def test_preemption_takes_the_most_recently_admitted():
    # 6 blocks of 2 tokens; three requests of 3-token prompts each need 2 blocks now and more as they decode.
    e = make_engine(num_blocks=6, block_size=2, max_model_len=64, enable_prefix_caching=False)
    w = SimWorker(6, 2)
    for i in range(3):
        e.submit(make_submit([10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=6, rid=f"p{i}"))
    plan = e.plan_step()
    assert [ns.seq_id for ns in plan.new_seqs] == [1, 2, 3] and e.kv.num_free == 0
    e.apply_result(w.step(plan))
    plan = e.plan_step()  # decodes of position 3: still in each request's second block
    assert plan.preempted == [] and [c.seq_id for c in plan.continuing] == [1, 2, 3]
    e.apply_result(w.step(plan))
    plan = e.plan_step()  # seq 1 needs a block for position 4 -> the latest admitted (seq 3) goes
    assert plan.preempted == [3]
    assert [c.seq_id for c in plan.continuing] == [1, 2]
    assert [len(c.new_block_ids) for c in plan.continuing] == [1, 1]
    assert e.waiting[0].request_id == "p2" and e.stats().num_preemptions >= 1
    e.apply_result(w.step(plan))
    outs = run_to_completion(e, w)
    assert set(outs) == {"p0", "p1", "p2"}
    # resumed with everything it knew: its NewSeq carries prompt + generated tokens
    resumed = [ns for p in w.plans for ns in p.new_seqs if ns.seq_id == 3][-1]
    assert resumed.token_ids[:3] == [21, 22, 23] and resumed.num_generated == len(resumed.token_ids) - 3


def test_refuses_requests_that_can_never_fit():
    e = make_engine(num_blocks=4, block_size=4, max_model_len=100)
    err = e.submit(make_submit(list(range(100)), max_tokens=1))
    assert err is not None and err.code == "context_length_exceeded" and err.status == 400
    assert "maximum context length is 100 tokens" in err.message
    err = e.submit(make_submit(list(range(10)), max_tokens=20))  # 29 KV tokens > 16 slots
    assert err is not None and err.code == "context_length_exceeded"
    assert "KV cache holds only 16 tokens" in err.message
    assert e.submit(make_submit(list(range(10)), max_tokens=7)) is None  # 16 KV tokens: fits exactly
    assert e.submit(make_submit([], max_tokens=1)).code == "invalid_request"
    assert e.submit(make_submit([1], max_tokens=0)).code == "invalid_request"
    assert not e.submit(make_submit([1], rid="dup")) and e.submit(make_submit([1], rid="dup")).code == "invalid_request"


def test_exactly_fitting_request_runs_to_the_end():
    e = make_engine(num_blocks=4, block_size=4, max_model_len=100)
    w = SimWorker(4, 4)
    e.submit(make_submit(list(range(1, 11)), max_tokens=7, rid="x"))
    outs = run_to_completion(e, w)
    assert len(tokens_of(outs["x"])) == 7 and outs["x"][-1].finish_reason == "length"


def test_stop_rules():
    stop = 5
    e = make_engine()
    e.submit(make_submit([1, 2], max_tokens=10, rid="stop", stop_token_ids=[stop]))
    e.submit(make_submit([1, 2], max_tokens=10, rid="min", stop_token_ids=[stop], min_tokens=2))
    # ignore_eos is the server's business (it leaves EOS out of the ids): a client's own stop ids still stop
    e.submit(make_submit([1, 2], max_tokens=3, rid="eos", stop_token_ids=[stop], ignore_eos=True))
    e.submit(make_submit([1, 2], max_tokens=10, rid="free"))
    short = make_engine(max_model_len=6)
    short.submit(make_submit([1, 2], max_tokens=10, rid="ctx"))
    got: dict[str, list] = {}
    for eng in (e, short):
        while (plan := eng.plan_step()) is not None:
            for o in eng.apply_result(sampled(plan, token=stop)):
                got.setdefault(o.request_id, []).append(o)
    assert tokens_of(got["stop"]) == [5] and got["stop"][-1].finish_reason == "stop"
    assert tokens_of(got["min"]) == [5, 5, 5] and got["min"][-1].finish_reason == "stop"
    assert tokens_of(got["eos"]) == [5] and got["eos"][-1].finish_reason == "stop"
    assert tokens_of(got["free"]) == [5] * 10 and got["free"][-1].finish_reason == "length"
    assert tokens_of(got["ctx"]) == [5] * 4 and got["ctx"][-1].finish_reason == "length"  # 2 + 4 = 6 tokens
    assert got["ctx"][0].num_prompt_tokens == 2
    assert all(o.finish_reason is None for outs in got.values() for o in outs[:-1])
    assert e.kv.num_free + e.kv.num_cached == e.kv.num_blocks


def test_abort_mid_step_drops_the_result_and_frees_blocks():
    e = make_engine(enable_prefix_caching=False)
    w = SimWorker(64, 4)
    e.submit(make_submit([1, 2, 3], max_tokens=10, rid="a"))
    e.submit(make_submit([4, 5, 6], max_tokens=10, rid="b"))
    plan = e.plan_step()
    out = e.abort("a")  # while step 1 is in flight
    assert out.finish_reason == "abort" and out.token_ids == [] and out.num_prompt_tokens == 3
    assert e.abort("a") is None
    outs = e.apply_result(w.step(plan))
    assert [o.request_id for o in outs] == ["b"]
    assert e.kv.num_free == 64 - 1
    plan = e.plan_step()
    assert plan.finished == [1] and [c.seq_id for c in plan.continuing] == [2]
    e.apply_result(w.step(plan))
    # aborting a waiting request
    e2 = make_engine()
    e2.submit(make_submit([1], rid="w"))
    assert e2.abort("w").finish_reason == "abort" and not e2.has_work and e2.plan_step() is None


def test_logprobs_only_when_asked():
    e = make_engine()
    w = SimWorker(64, 4)
    e.submit(make_submit([1, 2], max_tokens=2, rid="lp", logprobs=True))
    e.submit(make_submit([1, 2], max_tokens=2, rid="nolp"))
    outs = run_to_completion(e, w)
    assert all(o.logprobs == [-0.5] for o in outs["lp"])
    assert all(o.logprobs is None for o in outs["nolp"])


def test_a_failed_step_ends_its_requests_and_frees_their_blocks():
    e = make_engine()
    w = SimWorker(64, 4)
    e.submit(make_submit([1, 2, 3], max_tokens=5, rid="a"))
    e.apply_result(w.step(e.plan_step()))
    e.submit(make_submit([4, 5, 6], max_tokens=5, rid="b"))
    plan = e.plan_step()
    assert e.fail_step(plan.step + 1, "nope") == []  # not the step in flight
    errors = e.fail_step(plan.step, "kernel failed")
    assert sorted(x.request_id for x in errors) == ["a", "b"] and errors[0].code == "worker_error"
    assert not e.has_work and not e.in_flight and e.kv.num_free == 64 and e.kv.num_cached == 0
    e.check_invariants()


def test_a_prefix_cached_by_another_request_meanwhile_is_not_pinned():
    # "b" prefills the same first page as "a" at the same time; "a" caches it first. "b" must not pin a's copy
    # (it uses its own): alone, it needs every block of the cache, a's cached page included.
    e = make_engine(num_blocks=11, block_size=2, max_model_len=48, max_batch_tokens=2, max_batch_seqs=2,
                    chunked_prefill_size=1)
    w = SimWorker(11, 2, vocab_size=8)
    e.submit(make_submit([5, 6, 7], max_tokens=1, rid="a"))
    e.submit(make_submit([5, 6, 7, 4, 5, 6, 7, 4] + [1] * 9, max_tokens=5, rid="b"))  # 21 KV tokens = 11 blocks
    outs = run_to_completion(e, w)
    assert len(tokens_of(outs["b"])) == 5 and e.stats().num_preemptions == 0


def test_requests_that_each_need_the_whole_cache_take_turns():
    e = make_engine(num_blocks=4, block_size=2, max_model_len=48, enable_prefix_caching=True)
    w = SimWorker(4, 2)
    for i in range(3):
        e.submit(make_submit([1 + i, 2, 3], max_tokens=6, rid=f"x{i}"))  # 8 KV tokens each: exactly the cache
    outs = run_to_completion(e, w)  # asserts that no step comes back empty while work is left
    assert all(len(tokens_of(outs[f"x{i}"])) == 6 for i in range(3))
    assert e.stats().num_preemptions > 0


def test_a_result_that_does_not_match_its_step_fails_the_step():
    """A result with the wrong number of tokens (a protocol bug) cannot fill the step's PENDING tokens: the engine
    refuses it, keeps the step for fail_step, and failing it ends exactly that step's requests cleanly."""
    e = make_engine(max_inflight_steps=2)
    e.submit(make_submit([1, 2, 3], max_tokens=10, rid="a"))
    e.submit(make_submit([4, 5, 6], max_tokens=10, rid="b"))
    first = e.plan_step()
    assert first is not None
    bad = StepResult(step=first.step, seq_ids=[first.new_seqs[0].seq_id], token_ids=[7])
    with pytest.raises(ResultMismatch, match="1 sampled tokens for 2 sampling sequences"):
        e.apply_result(bad)
    assert e.in_flight and all(r.num_pending == 1 for r in e.running)
    errors = e.fail_step(first.step, "malformed")
    assert sorted(err.request_id for err in errors) == ["a", "b"]
    assert not e.in_flight and not e.requests and not e.running
    assert e.kv.num_free + e.kv.num_cached == e.kv.num_blocks
    e.check_invariants()


def test_a_penalised_request_waits_for_its_token_under_the_pipeline_and_a_grammar_row_does_not():
    """With the one-step-ahead pipeline a request with penalties is not planned into the step after one that
    samples its token: its next logits read that token's count. The batch's other requests are (a grammar row
    too: the worker feeds its matcher the token in flight), and the waiting one comes back in the step after, with
    every output the same as without the pipeline."""
    from infer_protocol.messages import SamplingParams, StructuredOutput

    def submits():
        grammar = SamplingParams(temperature=0.0, structured=StructuredOutput("json_object"))
        penalised = SamplingParams(temperature=0.0, presence_penalty=0.5)
        return [make_submit([1, 2, 3], max_tokens=6, rid="free"),
                msgspec.structs.replace(make_submit([4, 5, 6], max_tokens=6, rid="grammar"), sampling=grammar),
                msgspec.structs.replace(make_submit([7, 8, 9], max_tokens=6, rid="penalised"), sampling=penalised)]

    e = make_engine(max_inflight_steps=2)
    for s in submits():
        e.submit(s)
    ids = {r.request_id: r.seq_id for r in e.waiting}
    e.grammars_ready([ids["grammar"]])  # (its grammar compiled: the hold until then is tested below)
    first = e.plan_step()
    second = e.plan_step()  # planned while the first is in flight: the penalised request sits it out
    assert first is not None and second is not None
    assert {n.seq_id for n in first.new_seqs} == set(ids.values())
    assert [c.seq_id for c in second.continuing] == [ids["free"], ids["grammar"]]
    worker = SimWorker(64, 4)
    worker.ready.add(ids["grammar"])  # (as if it had reported the grammar)
    held = deque([worker.step(first), worker.step(second)])
    piped = run_to_completion(e, worker, held=held)
    alone = make_engine(max_inflight_steps=1)
    for s in submits():
        alone.submit(s)
    sync = run_to_completion(alone, SimWorker(64, 4))  # (here the grammar row waits for its report: same tokens)
    assert {k: tokens_of(v) for k, v in piped.items()} == {k: tokens_of(v) for k, v in sync.items()}
    assert all(len(tokens_of(v)) == 6 for v in piped.values())
