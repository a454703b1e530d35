"""A request with a grammar is held at its last prompt token until the worker reports its grammar compiled: the
planner prefills every prompt token but that one, then leaves the request out of the steps (admitted, its blocks
held) while the others run; the report releases it, and a grammar that fails ends that request alone."""

from __future__ import annotations

import msgspec

from infer_protocol.messages import SamplingParams, SeqError, StepResult, StructuredOutput, Submit

from .conftest import make_engine, make_submit
from .sim_worker import BAD_GRAMMAR, SimWorker, run_to_completion, tokens_of


def grammar_submit(prompt: list[int], rid: str, schema: str = "", max_tokens: int = 4) -> Submit:
    kind = "regex" if schema else "json_object"
    sampling = SamplingParams(temperature=0.0, structured=StructuredOutput(kind, schema))
    return msgspec.structs.replace(make_submit(prompt, max_tokens=max_tokens, rid=rid), sampling=sampling)


def sampled(plan, engine, token: int = 7) -> StepResult:
    ids = [sid for sid in [ns.seq_id for ns in plan.new_seqs] + [c.seq_id for c in plan.continuing]
           if engine._by_seq.get(sid) is not None and engine._by_seq[sid].num_pending]
    return StepResult(step=plan.step, seq_ids=ids, token_ids=[token] * len(ids))


def test_a_grammar_request_is_held_at_its_last_prompt_token_until_ready_and_others_proceed():
    e = make_engine(chunked_prefill_size=100)
    assert e.submit(grammar_submit([1, 2, 3, 4, 5, 6], "g", max_tokens=3)) is None
    assert e.submit(make_submit([11, 12, 13, 14], max_tokens=3, rid="free")) is None
    g, free = e.requests["g"].seq_id, e.requests["free"].seq_id
    plan = e.plan_step()
    assert [(ns.seq_id, ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(g, 0, 5), (free, 0, 4)]
    assert e.requests["g"].num_pending == 0 and e.requests["free"].num_pending == 1  # only the free one samples
    assert [o.request_id for o in e.apply_result(sampled(plan, e))] == ["free"]
    for _ in range(2):  # the free request decodes to its end; the held one is in no step
        plan = e.plan_step()
        assert [c.seq_id for c in plan.continuing] == [free] and not plan.new_seqs
        e.apply_result(sampled(plan, e))
        e.check_invariants()
    assert "free" not in e.requests and e.requests["g"].num_computed == 5
    assert e.plan_step() is None and e.has_work  # nothing to run while the grammar compiles: no empty step
    e.grammars_ready([g])
    plan = e.plan_step()
    assert [(c.seq_id, c.num_tokens) for c in plan.continuing] == [(g, 1)] and plan.finished == [free]
    outs = e.apply_result(sampled(plan, e, token=9))
    assert [(o.request_id, o.token_ids) for o in outs] == [("g", [9])]
    e.check_invariants()


def test_the_ready_report_rides_a_step_result_and_releases_the_request_two_steps_later_under_the_pipeline():
    e = make_engine(chunked_prefill_size=100, max_inflight_steps=2)
    e.submit(grammar_submit([1, 2, 3, 4, 5], "g", max_tokens=2))
    e.submit(make_submit([11, 12, 13], max_tokens=8, rid="free"))
    g = e.requests["g"].seq_id
    first, second = e.plan_step(), e.plan_step()
    assert [ns.num_tokens for ns in first.new_seqs] == [4, 3]  # g holds its fifth token
    assert [c.seq_id for c in second.continuing] == [e.requests["free"].seq_id]
    result = sampled(first, e)
    e.apply_result(msgspec.structs.replace(result, grammars_ready=[g]))  # a cache hit: ready at its first result
    third = e.plan_step()
    assert (g, 1) in [(c.seq_id, c.num_tokens) for c in third.continuing]


def test_a_grammar_that_fails_ends_its_request_alone_while_held():
    e = make_engine(chunked_prefill_size=100)
    e.submit(grammar_submit([1, 2, 3, 4, 5], "g", max_tokens=3))
    e.submit(make_submit([11, 12, 13], max_tokens=3, rid="free"))
    g = e.requests["g"].seq_id
    plan = e.plan_step()
    e.apply_result(sampled(plan, e))
    errors = e.fail_sequences([SeqError(g, "grammar_too_complex", "the grammar did not compile within 30 s")])
    assert [(err.request_id, err.code, err.status) for err in errors] == [("g", "grammar_too_complex", 400)]
    e.check_invariants()
    plan = e.plan_step()
    assert plan.finished == [g] and [c.seq_id for c in plan.continuing] == [e.requests["free"].seq_id]
    e.grammars_ready([g])  # a late report of a request that ended: no matter
    e.apply_result(sampled(plan, e))
    e.check_invariants()


def test_a_full_prompt_hit_still_leaves_something_to_compute_before_the_held_token():
    """A page-aligned match stops one token earlier for a held request, so its admission computes a token at least
    (a step of nothing would never get its grammar compiled: the worker compiles from the admission)."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    e = make_engine(block_size=4)
    e.submit(make_submit(prompt, max_tokens=1, rid="warm"))
    run_to_completion(e, SimWorker(64, 4))
    e.submit(make_submit(prompt, max_tokens=1, rid="free"))
    plan = e.plan_step()
    assert [(ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(8, 1)]
    e.apply_result(sampled(plan, e))
    e.submit(grammar_submit(prompt, "g"))
    plan = e.plan_step()
    assert [(ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(4, 4)]  # token 8 held
    e.submit(grammar_submit(prompt[:5], "g5"))
    e.apply_result(sampled(plan, e))
    plan = e.plan_step()
    assert [(ns.num_computed, ns.num_tokens) for ns in plan.new_seqs] == [(0, 4)]  # would hit 4, compute 1
    e.check_invariants()


def test_a_one_token_prompt_is_not_held():
    e = make_engine()
    e.submit(grammar_submit([5], "g"))
    plan = e.plan_step()
    assert [ns.num_tokens for ns in plan.new_seqs] == [1] and e.requests["g"].num_pending == 1


def test_held_requests_keep_the_accounting_under_preemption_and_release_in_any_order():
    """A cache too small for everyone: held requests are preempted (they are the newest and not scheduled), come
    back still held, and every request ends with the tokens it gets with an ample cache and grammars compiled at
    once; a bad grammar fails alone."""

    def subs():
        out = [grammar_submit([1 + i, 2, 3, 4, 5, 6, 7][: 3 + i], f"g{i}", max_tokens=5) for i in range(4)]
        out.insert(2, grammar_submit([9, 9, 9], "bad", schema=BAD_GRAMMAR))
        out += [make_submit([20 + i, 21, 22], max_tokens=6, rid=f"f{i}") for i in range(3)]
        return out

    def serve(num_blocks: int, grammar_steps: int, overlap: bool) -> tuple[dict, int]:
        e = make_engine(num_blocks=num_blocks, block_size=2, chunked_prefill_size=3, max_batch_tokens=8,
                        max_inflight_steps=2 if overlap else 1)
        for s in subs():
            assert e.submit(s) is None
        held_preempted = 0
        original = e.planner.preempt

        def preempt(victim, *args):
            nonlocal held_preempted
            held_preempted += victim.awaits_grammar
            original(victim, *args)

        e.planner.preempt = preempt
        outs = run_to_completion(e, SimWorker(num_blocks, 2, grammar_steps=grammar_steps))
        assert e.kv.num_free + e.kv.num_cached == e.kv.num_blocks and not e.requests
        return outs, held_preempted

    ref, _ = serve(256, 0, False)
    assert [(err.code, err.status) for err in ref["bad"]] == [("invalid_grammar", 400)]
    preempted_while_held = 0
    for grammar_steps in (0, 3, 50):
        for overlap in (False, True):
            got, n = serve(8, grammar_steps, overlap)
            preempted_while_held += n
            assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in ref.items()}
            assert [err.code for err in got["bad"]] == ["invalid_grammar"]
            assert {len(tokens_of(got[f"g{i}"])) for i in range(4)} == {5}
    assert preempted_while_held > 0
