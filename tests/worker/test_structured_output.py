"""Structured outputs in the worker, on the CPU with a tiny random llama and a hand-made vocabulary: a grammar row's
output follows its schema (greedy and sampled) and ends on the stop token, the free rows of the same batch get
exactly their unconstrained tokens, and a schema the grammar engine refuses fails its request alone."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infer_protocol.messages import ContinueSeq, NewSeq, SamplingParams, StepPlan, StructuredOutput
from infer_worker.application.structured_output import GrammarBook, compile_spec
from infer_worker.application.worker_service import WorkerService
from tests.worker.tiny_checkpoints import Engine, llama_config, write_checkpoint

xgr = pytest.importorskip("xgrammar")

EOS = 0
PIECES = ['{', '}', '[', ']', '"', ':', ',', ' ', '-', '.', *'0123456789', *'abcdefghijklmnopqrstuvwxyz',
          'true', 'false', 'null', '"a"', '"n"', '"tags"']
VOCAB = ['<eos>', *PIECES] + [f'<unused{i}>' for i in range(256 - 1 - len(PIECES))]
SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 1, "maximum": 20},
    "n": {"enum": ["x", "yy"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}},
    "required": ["a", "n", "tags"]}


def _tokenizer_info(vocab_size: int) -> object:
    return xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(llama_config(), path, seed=5)
    return path


def _structured(schema: dict | None) -> StructuredOutput:
    if schema is None:
        return StructuredOutput(kind="json_object")
    return StructuredOutput(kind="json_schema", schema=json.dumps(schema, sort_keys=True))


def _run(model_dir: Path, rows: list[SamplingParams], steps: int,
         timeout_s: float = 30.0) -> tuple[dict[int, list[int]], list]:
    """Drive a WorkerService like the scheduler does (stop on EOS); returns each row's tokens and the errors."""
    engine = Engine.open(model_dir, num_blocks=160)
    book = GrammarBook(_tokenizer_info, engine.spec.vocab_size, timeout_s=timeout_s)
    engine.runner.grammars = book
    service = WorkerService(engine.runner, grammars=book)
    blocks = iter(engine.free_blocks)
    prompt = [40 + i for i in range(5)]
    new = [NewSeq(seq_id=i, token_ids=list(prompt), num_computed=0, num_tokens=len(prompt),
                  block_ids=[next(blocks) for _ in range(2)], sampling=p,
                  stop_token_ids=[EOS] if p.structured is not None else []) for i, p in enumerate(rows)]
    out: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    errors = []
    live = set(out)
    result = service.step(StepPlan(step=1, new_seqs=new))
    for step in range(2, steps + 2):
        errors += result.seq_errors
        failed = {e.seq_id for e in result.seq_errors}
        finished = []
        for sid, tok in zip(result.seq_ids, result.token_ids):
            if sid in failed or sid not in live:
                continue
            out[sid].append(tok)
            if tok == EOS and rows[sid].structured is not None:
                live.discard(sid)
                finished.append(sid)
        for sid in failed & live:
            live.discard(sid)
            finished.append(sid)
        if not live:
            break
        total = len(prompt) + len(out[0])  # every live row has as many tokens (one a step)
        cont = [(sid, [next(blocks)] if (total % 4 == 0) else []) for sid in sorted(live)]
        result = service.step(StepPlan(step=step, continuing=[ContinueSeq(sid, 1, b) for sid, b in cont],
                                       finished=finished))
    return out, errors


def _text(tokens: list[int]) -> str:
    assert tokens and tokens[-1] == EOS, tokens  # the grammar completed: only the stop token was left
    return "".join(VOCAB[t] for t in tokens[:-1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_rows_follow_the_schema_and_free_rows_keep_their_tokens(model_dir: Path, temperature: float) -> None:
    free = SamplingParams(temperature=temperature, seed=3)
    free2 = SamplingParams(temperature=0.7, seed=9, top_k=20)
    steps = 40
    alone, _ = _run(model_dir, [free, free2], steps)
    constrained = SamplingParams(temperature=temperature, seed=4, structured=_structured(SCHEMA))
    obj = SamplingParams(temperature=temperature, seed=5, structured=_structured(None))
    mixed, errors = _run(model_dir, [free, free2, constrained, obj], steps)
    assert not errors
    n = min(len(alone[0]), len(mixed[0]))
    assert mixed[0][:n] == alone[0][:n] and mixed[1][:n] == alone[1][:n] and n >= 30
    value = json.loads(_text(mixed[2]))
    assert 1 <= value["a"] <= 20 and value["n"] in ("x", "yy") and set(value) == {"a", "n", "tags"}
    assert 1 <= len(value["tags"]) <= 2 and all(isinstance(t, bool) for t in value["tags"])
    # A random model rarely closes a free-form object within the steps: every token of it is one the grammar allows.
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(_tokenizer_info(256)).compile_json_schema('{"type": "object"}'))
    assert VOCAB[mixed[3][0]] == "{" and all(matcher.accept_token(t) for t in mixed[3])


@pytest.mark.parametrize("kind,text,check", [
    ("regex", "[a-c]{2,4}-[0-9]", lambda out: re.fullmatch("[a-c]{2,4}-[0-9]", out)),
    ("grammar", 'root ::= "true" | "null" | "x" [0-9]', lambda out: out in ("true", "null") or
     re.fullmatch("x[0-9]", out)),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": ",", "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "[", "end": "]", "content": {"type": "json_schema", "json_schema": {
            "type": "integer", "minimum": 3, "maximum": 7}}}]}}), lambda out: out in [f"[{i}]" for i in range(3, 8)]),
])
def test_regex_ebnf_and_structural_tag_grammars(model_dir: Path, kind: str, text: str, check: Any) -> None:
    row = SamplingParams(temperature=1.0, seed=3, structured=StructuredOutput(kind=kind, schema=text))
    out, errors = _run(model_dir, [row], 12)
    assert not errors and check(_text(out[0]))


_BOUNDED_STRINGS = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 8}, "code": {"type": "string", "minLength": 2},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["title", "code", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("kind,schema,prefix", [
    ("json_schema", json.dumps(_BOUNDED_STRINGS, sort_keys=True), ""),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": ",", "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<f>", "end": "</f>", "content": {
            "type": "json_schema", "json_schema": _BOUNDED_STRINGS}}]}}, sort_keys=True), "<f>"),
])
@pytest.mark.parametrize("field", ["title", "code", "tags"])
def test_bounded_json_strings_refuse_raw_control_characters(kind: str, schema: str, prefix: str, field: str) -> None:
    # xgrammar writes length-bounded strings with a class that admits raw tabs (json.loads refuses them): on the
    # H200 a random model's JSON outputs held raw tabs and half of them did not parse.
    compiled = compile_spec(xgr.GrammarCompiler(_tokenizer_info(256)), StructuredOutput(kind=kind, schema=schema))
    values = {"code": '"xy"', "tags": '["t"]', "title": '"ab"'}  # strict mode: the schema's (sorted) order
    body = lambda: prefix + "{" + ", ".join(f'"{k}": {v}' for k, v in values.items()) + "}"
    assert xgr.GrammarMatcher(compiled).accept_string(body())
    for raw in ("\t", "\x01", "\x1f"):
        values[field] = f'["a{raw}"]' if field == "tags" else f'"a{raw}b"'
        assert not xgr.GrammarMatcher(compiled).accept_string(body()), (field, raw)
    values[field] = '["a b"]' if field == "tags" else '"a b"'
    assert xgr.GrammarMatcher(compiled).accept_string(body())


@pytest.mark.parametrize("kind,text", [("regex", "(("), ("grammar", "root ::= undefined_rule"),
                                       ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}')])
def test_a_broken_regex_or_grammar_fails_that_request_alone(model_dir: Path, kind: str, text: str) -> None:
    free = SamplingParams(temperature=0.0)
    alone, _ = _run(model_dir, [free], 4)
    mixed, errors = _run(model_dir, [free, SamplingParams(structured=StructuredOutput(kind=kind, schema=text))], 4)
    assert [(e.seq_id, e.code, e.status) for e in errors] == [(1, "invalid_grammar", 400)]
    assert "/project/cpp" not in errors[0].message and mixed[0] == alone[0]


def test_a_schema_the_engine_refuses_fails_that_request_alone(model_dir: Path) -> None:
    free = SamplingParams(temperature=0.0)
    bad = SamplingParams(temperature=0.0, structured=StructuredOutput(kind="json_schema", schema='{"type": "nope"}'))
    alone, _ = _run(model_dir, [free], 6)
    mixed, errors = _run(model_dir, [free, bad], 6)
    assert [(e.seq_id, e.code, e.status) for e in errors] == [(1, "invalid_grammar", 400)]
    assert mixed[0] == alone[0] and mixed[1] == []


def _slow_compiles(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    """Make the compilation of each schema in `seconds` take that long (on its compile thread); the schemas whose
    compilation ended, in order, are returned (filled as they end)."""
    import time

    from infer_worker.application import structured_output

    real = structured_output.GrammarBook._compile_now
    ended: list[str] = []

    def slow(self: GrammarBook, spec: StructuredOutput) -> object:
        compiled = real(self, spec)
        time.sleep(seconds.get(spec.schema, 0.0))  # (a timed-out one finishes later; nothing waits for it)
        ended.append(spec.schema)
        return compiled

    monkeypatch.setattr(structured_output.GrammarBook, "_compile_now", slow)
    return ended


def test_a_grammar_still_compiling_at_the_deadline_fails_that_request_alone(model_dir: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_compiles(monkeypatch, {'{"type": "integer"}': 2.0})
    slow_row = SamplingParams(temperature=0.0, structured=StructuredOutput(kind="json_schema",
                                                                           schema='{"type": "integer"}'))
    _, errors = _run(model_dir, [SamplingParams(temperature=0.0), slow_row], 3, timeout_s=0.3)
    assert [(e.seq_id, e.code) for e in errors] == [(1, "grammar_too_complex")]


def _timed_serve(model_dir: Path, subs: list, timeout_s: float = 30.0, overlap: bool = True
                 ) -> tuple[dict[str, tuple[list[int], str | None]], list[float], list[bool], list]:
    """tests/worker/test_overlap_pipeline.serve with a grammar book, also returning each step's host time (launch
    and collect), whether any first sample waited for a compilation, and the failures reported."""
    import time

    from infer_protocol.messages import StepResult
    from tests.worker.test_overlap_pipeline import make_runner, serve

    runner = make_runner(model_dir, False, 256)
    book = runner.grammars = GrammarBook(_tokenizer_info, runner.model.spec.vocab_size, timeout_s=timeout_s)
    times: list[float] = []
    waited: list[bool] = []
    errors: list = []
    real_matcher = book._matcher

    def matcher(state: Any, wait: bool) -> None:
        waited.append(wait and not state.compiled.future.done())
        real_matcher(state, wait)

    book._matcher = matcher  # type: ignore[method-assign]
    from infer_worker.application import worker_service

    real_launch, real_collect = worker_service.WorkerService.launch, worker_service.WorkerService.collect

    def launch(self: Any, plan: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_launch(self, plan)
        finally:
            times.append(time.perf_counter() - started)

    def collect(self: Any) -> Any:
        started = time.perf_counter()
        try:
            result = real_collect(self)
        finally:
            times.append(time.perf_counter() - started)
        if isinstance(result, StepResult):
            errors.extend(result.seq_errors)
        return result

    real_status = worker_service.WorkerService.grammar_status

    def grammar_status(self: Any) -> Any:
        status = real_status(self)
        if status is not None:
            errors.extend(status.errors)
        return status

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_service.WorkerService, "launch", launch)
        mp.setattr(worker_service.WorkerService, "collect", collect)
        mp.setattr(worker_service.WorkerService, "grammar_status", grammar_status)
        out, _ = serve(runner, subs, overlap=overlap, num_blocks=256, max_model_len=64, initial=len(subs))
    return out, times, waited, errors


def _grammar_batch(slow_schema: str, free_tokens: int = 24) -> list:
    from infer_protocol.messages import Submit

    free = [Submit(request_id=f"free{i}", prompt_token_ids=[3, 9, 27] + [50 + 7 * i + j for j in range(i + 2)],
                   sampling=SamplingParams(temperature=0.0 if i == 0 else 0.8, seed=i, top_k=30),
                   max_tokens=free_tokens, stop_token_ids=[EOS]) for i in range(2)]
    slow = Submit(request_id="slow", prompt_token_ids=[3, 9, 27, 60, 61, 62], max_tokens=30, stop_token_ids=[EOS],
                  sampling=SamplingParams(temperature=0.0, structured=StructuredOutput("json_schema", slow_schema)))
    return [free[0], slow, free[1]]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_free_rows_run_every_step_while_a_grammar_compiles_and_keep_their_tokens(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """The scheduler holds the constrained row at its last prompt token while its grammar compiles (slowly here:
    1.5 s), so no step waits for the compilation: the free rows produce a token every step meanwhile, exactly those
    they get alone, and the constrained row, released by the worker's report, follows its schema."""
    schema = json.dumps(SCHEMA, sort_keys=True)
    ended = _slow_compiles(monkeypatch, {schema: 1.5})
    subs = _grammar_batch(schema)
    alone, _, _, _ = _timed_serve(model_dir, [s for s in subs if s.request_id != "slow"], overlap=overlap)
    mixed, times, waited, errors = _timed_serve(model_dir, subs, overlap=overlap)
    assert not errors and not any(waited)  # no first sample waited for its grammar
    assert max(times) < 0.75, max(times)  # no step stalled for the compilation (1.5 s)
    for rid in ("free0", "free1"):
        assert mixed[rid] == alone[rid] and len(mixed[rid][0]) == 24
    assert ended == [schema]  # (compiled once)
    tokens, reason = mixed["slow"]  # (a random model may not close the object within its max_tokens)
    matcher = xgr.GrammarMatcher(compile_spec(xgr.GrammarCompiler(_tokenizer_info(256)), subs[1].sampling.structured),
                                 override_stop_tokens=[EOS])
    assert tokens and all(matcher.accept_token(t) for t in tokens) and reason in ("stop", "length")


def test_a_grammar_past_its_deadline_fails_alone_while_the_batch_runs(model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A compilation that runs past the deadline (1 s here, 4 s of compiling) fails its request alone (a 400 through
    the worker's report), and no step waits for it: the free rows and another grammar row run to their ends."""
    _slow_compiles(monkeypatch, {'{"type": "integer"}': 4.0})
    subs = _grammar_batch('{"type": "integer"}', free_tokens=40)
    later = msgspec.structs.replace(subs[1], request_id="later", sampling=SamplingParams(
        temperature=0.0, structured=_structured(SCHEMA)), prompt_token_ids=[3, 9, 27, 70])
    started = __import__("time").perf_counter()
    out, times, waited, errors = _timed_serve(model_dir, [*subs, later], timeout_s=1.0)
    assert __import__("time").perf_counter() - started < 3.5  # nothing waited for the 4 s compilation
    assert [(e.code, e.status) for e in errors] == [("grammar_too_complex", 400)]
    assert not any(waited) and max(times) < 0.6  # (a step that waited for the grammar would take 1 s)
    assert out["slow"] == ([], None)  # (failed: its error went to the scheduler, no token came)
    assert len(out["free0"][0]) == 40 and out["later"][1] in ("stop", "length") and out["later"][0]


def test_the_deadline_runs_from_the_compilation_and_a_timed_out_one_blocks_no_later_grammar(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence preempted and re-admitted while its grammar compiles keeps the deadline of the compilation it
    asked for first; once past it, that compilation keeps its thread, and later grammars compile on the others; a
    cached grammar is ready at the first poll."""
    import time

    from infer_worker.domain.sequence import Grammar, Sampling, Sequence

    ended = _slow_compiles(monkeypatch, {"[0-9]+": 3.0})
    book = GrammarBook(_tokenizer_info, 256, timeout_s=1.0)

    def seq(i: int, pattern: str) -> Sequence:
        return Sequence(i, [1, 2, 3], 0, [0], Sampling(temperature=0.0, structured=Grammar("regex", pattern)),
                        prompt_len=3, stop_token_ids=(EOS,))

    book.admit(seq(1, "[0-9]+"))
    book.admit(seq(2, "[a-c]+"))
    started = time.monotonic()
    ready: list[int] = []
    while not ready and time.monotonic() - started < 5:
        ready += book.poll()[0]
        time.sleep(0.005)
    assert ready == [2]
    time.sleep(max(0.0, started + 0.6 - time.monotonic()))
    book.forget(1)  # preempted ...
    book.admit(seq(1, "[0-9]+"))  # ... and re-admitted: its compilation is the one asked 0.6 s ago
    errors: list = []
    while not errors and time.monotonic() - started < 5:
        errors += book.poll()[1]
        time.sleep(0.005)
    assert [(e.seq_id, e.code) for e in errors] == [(1, "grammar_too_complex")]
    assert time.monotonic() - started < 1.4  # (1 s from the first admission, not 1.6 s)
    book.admit(seq(3, "[a-c]+"))  # a cached grammar: ready at once
    assert book.poll() == ([3], [])
    book.admit(seq(4, "x[0-9]"))  # a new grammar, while the timed-out one still compiles (3 s)
    while not ready[1:] and time.monotonic() - started < 5:
        ready += book.poll()[0]
        time.sleep(0.005)
    assert ready == [2, 4] and time.monotonic() - started < 2.8 and ended == ["[a-c]+", "x[0-9]"]
    book.admit(seq(5, "[0-9]+"))  # the timed-out grammar again: failed at once (it would queue behind itself)
    assert [(e.seq_id, e.code) for e in book.poll()[1]] == [(5, "grammar_too_complex")]
    assert not book.compiling


def test_the_scheduler_sends_stop_ids_and_fails_a_sequence_alone() -> None:
    from infer_protocol.messages import SeqError, StepResult, Submit
    from infer_scheduler.engine import Engine as SchedulerEngine

    eng = SchedulerEngine(num_blocks=16, block_size=4, max_model_len=64)
    spec = StructuredOutput(kind="json_object")
    eng.submit(Submit(request_id="a", prompt_token_ids=[1, 2, 3], max_tokens=8, stop_token_ids=[9, 2],
                      sampling=SamplingParams(structured=spec)))
    eng.submit(Submit(request_id="b", prompt_token_ids=[4, 5], max_tokens=8, stop_token_ids=[9],
                      sampling=SamplingParams()))
    plan = eng.plan_step()
    assert plan is not None
    assert [ns.stop_token_ids for ns in plan.new_seqs] == [[2, 9], []]  # the matcher's stop tokens
    assert [ns.num_tokens for ns in plan.new_seqs] == [2, 2]  # a's last prompt token waits for its grammar
    sids = [ns.seq_id for ns in plan.new_seqs]
    errors = eng.fail_sequences([SeqError(sids[0], "invalid_grammar", "bad schema")])
    assert [(e.request_id, e.code, e.status) for e in errors] == [("a", "invalid_grammar", 400)]
    outs = eng.apply_result(StepResult(step=1, seq_ids=[sids[1]], token_ids=[12]))
    assert [(o.request_id, o.token_ids) for o in outs] == [("b", [12])]
    plan = eng.plan_step()
    assert plan is not None and plan.finished == [sids[0]] and [c.seq_id for c in plan.continuing] == [sids[1]]


def check_structured_through_the_engine(model_dir: Path, graphs: bool, make_backend: Any,
                                        compare_free: bool = True, masked_graphs: bool = True
                                        ) -> dict[str, tuple[list[int], str | None]]:
    """The scheduler's engine and the worker service as their loops drive them (tests/worker/test_overlap_pipeline):
    schema rows beside free ones, one-step-ahead pipeline or not, eager or graph replay, and a KV cache tight enough
    to preempt (a recomputed constrained row's matcher replays its output). `masked_graphs`: whether graph runs
    sample grammar rows through the masked sampling graphs (False under INFER_MASKED_SAMPLING=0). Returns each
    request's (tokens, finish reason) under the one-step-ahead pipeline."""
    from infer_protocol.messages import Submit
    from tests.worker.test_overlap_pipeline import make_runner, serve

    def submits(constrained: bool) -> list[Submit]:
        out = []
        for i in range(6):
            structured = _structured(SCHEMA if i % 2 else None) if constrained and i in (1, 3, 4) else None
            sampling = SamplingParams(temperature=0.0 if i < 3 else 0.9, seed=i, top_k=30, structured=structured)
            out.append(Submit(request_id=f"r{i}", prompt_token_ids=[3, 9, 27] + [(11 * i + j) % 200 + 50
                              for j in range(2 * i)], sampling=sampling, max_tokens=40 if structured else 12,
                              stop_token_ids=[EOS]))
        return out

    preemptions: list[int] = []
    in_flight_fed: list[int] = []
    logits_graph_steps: list[int] = []
    masked_graph_steps: list[int] = []

    def run(subs: list[Submit], overlap: bool, num_blocks: int) -> dict[str, tuple[list[int], str | None]]:
        runner = make_runner(model_dir, graphs, num_blocks, make_backend())
        runner.grammars = GrammarBook(_tokenizer_info, runner.model.spec.vocab_size)
        out, engine = serve(runner, subs, overlap=overlap, num_blocks=num_blocks, max_model_len=64)
        preemptions.append(engine.counters.preemptions)
        in_flight_fed.append(runner.grammars.pending_resolved)
        logits_graph_steps.append(getattr(runner, "decode_logits_steps", 0))
        masked_graph_steps.append(getattr(runner, "masked_sample_steps", 0))
        return out

    mixed = submits(True)
    results = [run(mixed, overlap, blocks) for overlap, blocks in ((True, 256), (False, 256), (True, 16))]
    # Under the pipeline a grammar row rides every step, its matcher fed the token still in flight, and the
    # pipelines agree; preempted and recomputed, a constrained row's matcher replays its output and goes on.
    assert results[0] == results[1] == results[2] and preemptions[2] > 0
    assert in_flight_fed[0] > 10 and in_flight_fed[1] == 0 and in_flight_fed[2] > 0
    # With graphs, the grammar rows' decode steps replay the decode graphs that stop at the logits.
    assert all(n > 10 for n in logits_graph_steps) if graphs else not any(logits_graph_steps)
    # ... and sample through the masked sampling graphs (a grammar is their only processing).
    assert all(n > 10 for n in masked_graph_steps) if graphs and masked_graphs else not any(masked_graph_steps)
    for out in results:
        for sub in mixed:
            tokens, reason = out[sub.request_id]
            if sub.sampling.structured is None:
                continue
            if reason == "stop":
                value = json.loads(_text(tokens))
                if sub.sampling.structured.kind == "json_schema":
                    assert 1 <= value["a"] <= 20 and value["n"] in ("x", "yy") and 1 <= len(value["tags"]) <= 2
            else:
                assert reason == "length" and VOCAB[tokens[0]] == "{"
    assert any(out[f"r{i}"][1] == "stop" for i in (1, 3) for out in results)
    if compare_free:
        free = run(submits(False), True, 256)
        for sub in mixed:
            if sub.sampling.structured is None:
                assert results[0][sub.request_id] == free[sub.request_id]
    return results[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
def test_structured_rows_through_the_scheduler_engine(model_dir: Path, graphs: bool) -> None:
    from tests.worker.test_graph_runner import ReplayingCpuBackend

    check_structured_through_the_engine(model_dir, graphs, ReplayingCpuBackend)


def test_admission_gives_the_domain_its_own_grammar_value() -> None:
    from infer_worker.application.worker_service import to_sampling
    from infer_worker.domain.sequence import Grammar

    wire = SamplingParams(temperature=0.5, structured=StructuredOutput(kind="json_schema", schema='{"type":"object"}'))
    assert to_sampling(wire).structured == Grammar("json_schema", '{"type":"object"}')
    assert to_sampling(wire).temperature == 0.5 and to_sampling(SamplingParams()).structured is None


def test_a_tokenizer_the_grammar_engine_cannot_read_fails_each_request_without_retrying() -> None:
    """The factory's refusal (e.g. grammar_tokenizer's decode self-check) fails every constrained request with a
    400 that says why, and is not retried: each retry would cost the vocabulary scan again, under the lock."""
    import torch

    from infer_worker.domain.sequence import Grammar, Sampling, Sequence

    calls = []

    def misread(vocab_size: int) -> object:
        calls.append(vocab_size)
        raise ValueError("the grammar engine reads this tokenizer's vocabulary differently from its decoder")

    book = GrammarBook(misread, 64)
    seqs = [Sequence(i, [1, 2, 3], 3, [0], Sampling(temperature=0.0, structured=Grammar("regex", pattern)),
                     stop_token_ids=(EOS,)) for i, pattern in enumerate(["a+", "b+"])]
    for seq in seqs:
        book.admit(seq)
    errors = book.mask(torch.zeros(2, 64), seqs, [0, 1], lambda a: torch.from_numpy(a))
    assert [(e.seq_id, e.code, e.status) for e in errors] == [(0, "invalid_grammar", 400), (1, "invalid_grammar", 400)]
    assert all("differently from its decoder" in e.message for e in errors)
    assert calls == [64]


def _reference_refused(spec: StructuredOutput, generated: list[int]) -> "np.ndarray":
    """The tokens a fresh matcher of `spec`, fed `generated`, refuses: its own bitmask, filled alone and unpacked
    with numpy (bit i of word j is token 32 j + i)."""
    import numpy as np

    matcher = xgr.GrammarMatcher(compile_spec(xgr.GrammarCompiler(_tokenizer_info(256)), spec),
                                 override_stop_tokens=[EOS])
    assert all(matcher.accept_token(t) for t in generated)
    bitmask = xgr.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(bitmask)
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:256] == 0


@pytest.mark.parametrize("threads", [1, 4])
def test_the_batched_fill_masks_each_row_as_its_own_matcher_would(threads: int) -> None:
    """GrammarBook.mask fills every row's bitmask in one batched call into a reused buffer: each masked row gets
    exactly the mask its matcher alone would fill, over steps whose rows are in other grammar states, fewer and then
    more rows than before (the buffer grows); free, terminated and failed rows keep their logits."""
    import numpy as np
    import torch

    from infer_worker.domain.sequence import PENDING, Grammar, Sampling, Sequence

    tok = VOCAB.index
    schema, obj = _structured(SCHEMA), _structured(None)
    specs: dict[int, StructuredOutput | None] = {
        0: None, 1: schema, 2: schema, 3: obj,
        4: StructuredOutput(kind="regex", schema="ab"),  # completes, then accepts its stop token: terminated
        5: StructuredOutput(kind="json_schema", schema='{"type": "nope"}'),  # refused by the engine: failed
        6: StructuredOutput(kind="regex", schema="[0-9]+"), 7: None}
    generated = {0: [tok("x")], 1: [], 2: [tok("{"), tok('"a"'), tok(":")], 3: [tok("{")],
                 4: [tok("a"), tok("b"), EOS], 5: [], 6: [tok("4"), PENDING], 7: []}
    pending = {6: tok("7")}  # the in-flight token of row 6, as the previous launch sampled it
    prompt = [tok("q"), tok("r")]
    book = GrammarBook(_tokenizer_info, 256, threads=threads)

    def sequence(i: int) -> Sequence:
        spec = specs[i]
        grammar = None if spec is None else Grammar(spec.kind, spec.schema)
        seq = Sequence(i, prompt + generated[i], len(prompt), [0], Sampling(temperature=0.0, structured=grammar),
                       prompt_len=len(prompt), stop_token_ids=(EOS,))
        if grammar is not None:
            book.admit(seq)
        return seq

    seqs = [sequence(i) for i in range(8)]
    generator = torch.Generator().manual_seed(0)

    def step(rows: list[int], expect_masked: list[int]) -> list:
        logits = torch.randn((len(seqs), 256), generator=generator)
        expected = logits.clone()
        refused = {}
        for row in expect_masked:
            history = [pending.get(row, t) if t == PENDING else t for t in generated[row]]
            refused[row] = _reference_refused(specs[row], history)
            expected[row, torch.from_numpy(refused[row])] = float("-inf")
        errors = book.mask(logits, seqs, rows, lambda a: torch.from_numpy(a), lambda s: pending[s.seq_id])
        assert torch.equal(logits, expected)
        masks = [refused[row].tobytes() for row in expect_masked]
        assert len(set(masks)) == len(masks)  # each row in its own state: a row given another's mask would show
        return errors

    grammar_rows = [1, 2, 3, 4, 5, 6]
    errors = step(grammar_rows, [1, 2, 3, 6])
    assert [(e.seq_id, e.code) for e in errors] == [(5, "invalid_grammar")]
    assert book.pending_resolved == 1
    # The next step: row 6's token is back, rows move on (row 1 opens its object, row 3 its first key); fewer rows.
    for row, token in ((1, tok("{")), (3, tok('"'))):
        generated[row].append(token)
        seqs[row].token_ids.append(token)
    generated[6][-1] = seqs[6].token_ids[-1] = pending.pop(6)
    assert step([1, 3, 5], [1, 3]) == []  # (a failed row is reported once)
    # More rows than the buffer has held: two more sequences arrive, in their own states.
    specs[8], generated[8] = StructuredOutput(kind="regex", schema="[a-c]{2}"), [tok("b")]
    specs[9], generated[9] = schema, [tok("{"), tok('"a"'), tok(":"), tok(" "), tok("1"), tok("2")]
    seqs += [sequence(8), sequence(9)]
    assert step([1, 2, 3, 4, 6, 8, 9], [1, 2, 3, 6, 8, 9]) == []


def test_fill_threads_default_to_the_calling_thread_and_follow_the_environment() -> None:
    from infer_worker.application.structured_output import FILL_THREADS_ENV, fill_threads

    assert fill_threads({}) == 1
    cores = len(os.sched_getaffinity(0))
    assert fill_threads({FILL_THREADS_ENV: "8"}) == max(1, min(8, cores // 2 or 1))
    assert fill_threads({FILL_THREADS_ENV: "0"}) == 1
    with pytest.raises(ValueError, match=FILL_THREADS_ENV):
        fill_threads({FILL_THREADS_ENV: "many"})
