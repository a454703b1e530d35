"""The logits-processing step (penalties, min_tokens masking, raw top-k logprobs) against plain reference
formulas and HF transformers, and the fast path: nothing runs (and CUDA graphs keep replaying) unless a row
asks for it. Also the scheduler's side of the wire: stop ids for min_tokens in NewSeq, top logprobs into
TokenOutput."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from infer_core.dtypes import DType
from infer_protocol.messages import NewSeq, SamplingParams, StepPlan, StepResult, Submit
from infer_scheduler.engine import Engine as SchedulerEngine
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.logits_processing import (
    plan_processing,
    process_logits,
    raw_logprobs,
    top_logprobs,
)
from infer_worker.application.model_runner import ModelRunner
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.test_graph_runner import ReplayingCpuBackend
from tests.worker.tiny_checkpoints import Engine, llama_config, qwen3_config, write_checkpoint

V = 40
to_device = torch.from_numpy


def _seq(tokens: list[int], prompt_len: int, sampling: Sampling, stop: tuple[int, ...] = ()) -> Sequence:
    return Sequence(0, list(tokens), len(tokens) - 1, [0], sampling, prompt_len=prompt_len, stop_token_ids=stop)


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], p: Sampling) -> list[float]:
    """vLLM's / HF's formulas, one token at a time."""
    out = list(logits)
    for v in range(len(out)):
        if v in prompt or v in output:
            out[v] = out[v] / p.repetition_penalty if out[v] > 0 else out[v] * p.repetition_penalty
        count = output.count(v)
        out[v] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_match_the_reference_formula() -> None:
    rng = np.random.default_rng(3)
    cases = [
        Sampling(presence_penalty=0.7),
        Sampling(frequency_penalty=-0.4),
        Sampling(repetition_penalty=1.3),
        Sampling(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
        Sampling(),  # a row without penalties in the same batch stays untouched
    ]
    seqs = []
    for i, p in enumerate(cases):
        prompt = rng.integers(0, V, size=5 + i).tolist()
        output = rng.integers(0, V, size=3 * i + 1).tolist() + [prompt[0], prompt[0]]
        seqs.append(_seq(prompt + output, len(prompt), p))
    logits = torch.from_numpy(rng.normal(0, 2, size=(len(seqs), V)).astype(np.float32))
    plan = plan_processing(seqs)
    assert plan is not None and plan.penalties is not None and plan.penalties.rows.tolist() == [0, 1, 2, 3]
    got = process_logits(logits, plan, to_device)
    assert got is not logits
    for row, s in enumerate(seqs):
        want = reference_penalties(logits[row].tolist(), s.token_ids[: s.prompt_len], s.token_ids[s.prompt_len:],
                                   s.sampling)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), row
    assert torch.equal(logits, logits.clone())  # the raw logits are not modified in place


def test_min_tokens_masks_stop_ids_until_enough_tokens_are_out() -> None:
    p = Sampling(min_tokens=3)
    short = _seq([1, 2, 3, 9, 9], 3, p, stop=(5, 7))  # 2 generated < 3: masked
    done = _seq([1, 2, 3, 9, 9, 9], 3, p, stop=(5, 7))  # 3 generated: free
    assert short.needs_processing and not done.needs_processing
    assert plan_processing([done]) is None
    logits = torch.zeros((2, V))
    plan = plan_processing([short, done])
    assert plan is not None
    got = process_logits(logits, plan, to_device)
    assert got[0, 5] == -math.inf and got[0, 7] == -math.inf and torch.isfinite(got[0, [0, 1, 6, 8]]).all()
    assert torch.isfinite(got[1]).all()
    # without stop ids (ignore_eos) there is nothing to mask
    assert plan_processing([_seq([1, 2, 3], 3, p)]) is None


def test_logit_bias_is_added_before_the_penalties_and_leaves_masks_alone() -> None:
    rng = np.random.default_rng(11)
    biased = Sampling(logit_bias=((2, 5.0), (7, -100.0), (39, 0.5)))
    both = Sampling(logit_bias=((4, 3.0), (5, 1.0)), repetition_penalty=2.0, min_tokens=4)
    seqs = [
        _seq([1, 2, 3, 9], 3, biased),
        _seq([1, 4, 8, 8], 3, Sampling()),  # an unbiased row in the same batch stays untouched
        _seq([4, 6, 8, 8], 3, both, stop=(5,)),  # 1 generated < min_tokens: token 5 masked, bias or not
    ]
    assert all(s.needs_processing for s in (seqs[0], seqs[2])) and not seqs[1].needs_processing
    logits = torch.from_numpy(rng.normal(0, 2, size=(3, V)).astype(np.float32))
    plan = plan_processing(seqs)
    assert plan is not None and plan.bias_rows.tolist() == [0, 0, 0, 2, 2]
    got = process_logits(logits, plan, to_device)
    want = logits.clone()
    for token, bias in biased.logit_bias:
        want[0, token] += bias
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], logits[1])
    row = logits[2].clone()
    row[4] += 3.0  # biased first, then penalised as a seen token (4 is in the prompt)
    row[4] = row[4] / 2.0 if row[4] > 0 else row[4] * 2.0
    for seen in (6, 8):
        row[seen] = row[seen] / 2.0 if row[seen] > 0 else row[seen] * 2.0
    row[5] = -math.inf
    assert got[2].tolist() == pytest.approx(row.tolist(), rel=1e-6, abs=1e-6)
    # logprobs stay those of the raw distribution for the biased rows too
    assert 0 in plan.modified_rows.tolist() and 2 in plan.modified_rows.tolist()


def test_allowed_token_ids_mask_every_other_token_after_the_bias() -> None:
    rng = np.random.default_rng(12)
    only = Sampling(allowed_token_ids=(3, 17, 38))
    biased = Sampling(allowed_token_ids=(0, 5), logit_bias=((5, 2.0), (6, 50.0)))
    seqs = [_seq([1, 2, 9], 2, only), _seq([1, 2, 9], 2, Sampling()), _seq([4, 4], 1, biased)]
    assert seqs[0].needs_processing and not seqs[1].needs_processing
    logits = torch.from_numpy(rng.normal(0, 2, size=(3, V)).astype(np.float32))
    plan = plan_processing(seqs)
    assert plan is not None and plan.allow_rows.tolist() == [0, 2]
    got = process_logits(logits, plan, to_device)
    kept = torch.isfinite(got)
    assert kept[0].nonzero().flatten().tolist() == [3, 17, 38]
    assert torch.equal(got[0, [3, 17, 38]], logits[0, [3, 17, 38]]) and torch.equal(got[1], logits[1])
    assert kept[2].nonzero().flatten().tolist() == [0, 5]  # the bias on 6 does not let it back in
    assert got[2, 5].item() == pytest.approx(logits[2, 5].item() + 2.0) and got[2, 0] == logits[2, 0]
    assert set(plan.modified_rows.tolist()) == {0, 2}


def test_greedy_logit_bias_equals_hf_generate_with_sequence_bias(llama_dir: tuple[Path, object]) -> None:
    path, hf = llama_dir
    prompt = [5, 9, 9, 17, 3, 5, 9, 44]
    engine = Engine.open(path)
    plain = engine.new_seq(1, prompt)
    engine.step([(plain, len(prompt))])
    for _ in range(9):
        engine.step([(plain, 1)])
    unbiased = plain.token_ids[len(prompt):]
    # push down the two tokens greedy picks first, pull up one it never picks
    bias = {unbiased[0]: -8.0, unbiased[1]: -3.5, next(t for t in range(V) if t not in unbiased): 2.5}
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,  # type: ignore[attr-defined]
                          sequence_bias={(t,): b for t, b in bias.items()})
    expected = out[0, len(prompt):].tolist()
    biased = engine.new_seq(2, prompt, Sampling(temperature=0.0, logit_bias=tuple(sorted(bias.items()))))
    engine.step([(biased, len(prompt))])
    for _ in range(9):
        engine.step([(biased, 1)])
    assert biased.token_ids[len(prompt):] == expected
    assert expected != unbiased  # the bias made a difference on this prompt


def test_top_logprobs_and_sampled_logprobs_are_of_the_raw_distribution() -> None:
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(rng.normal(0, 3, size=(3, V)).astype(np.float32))
    seqs = [
        _seq([1, 2, 3], 2, Sampling(logprobs=True, top_logprobs=4, repetition_penalty=2.0)),
        _seq([1, 2, 3], 2, Sampling(logprobs=True)),  # the sampled token's logprob only
        _seq([4, 5], 1, Sampling(logprobs=True, top_logprobs=20)),
    ]
    plan = plan_processing(seqs)
    assert plan is not None
    tops = top_logprobs(raw, plan, 3, to_device)
    ref = torch.log_softmax(raw, dim=-1)
    assert tops is not None and [len(t) for t in tops] == [4, 0, 20]
    for row in (0, 2):
        values, ids = ref[row].topk(len(tops[row]))
        assert [t for t, _ in tops[row]] == ids.tolist()
        assert [v for _, v in tops[row]] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(tops[row], tops[row][1:]))
    # row 0's logits were penalised: its sampled logprob is recomputed from the raw logits
    chosen = torch.tensor([3, 7, 11])
    sampler_lps = torch.tensor([-50.0, -1.25, -2.5])  # what a sampler computed from the logits it saw
    got = raw_logprobs(raw, chosen, sampler_lps, plan, to_device)
    assert got[0].item() == pytest.approx(ref[0, 3].item(), abs=1e-6)
    assert got[1:].tolist() == [-1.25, -2.5]


def test_nothing_requested_means_no_plan() -> None:
    seqs = [_seq([1, 2, 3], 2, Sampling(logprobs=True, top_logprobs=0)), _seq([4], 1, Sampling())]
    assert plan_processing(seqs) is None
    assert not any(s.needs_processing for s in seqs)


# ---------------------------------------------------------------- through the runners


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("llama-pen")
    hf = write_checkpoint(llama_config(), path, seed=4)
    return path, hf


def test_greedy_repetition_penalty_equals_hf_generate(llama_dir: tuple[Path, object]) -> None:
    path, hf = llama_dir
    prompt = [5, 9, 9, 17, 3, 5, 9, 44]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,  # type: ignore[attr-defined]
                          repetition_penalty=1.3)
    expected = out[0, len(prompt):].tolist()
    engine = Engine.open(path)
    plain = engine.new_seq(1, prompt)
    penalised = engine.new_seq(2, prompt, Sampling(temperature=0.0, repetition_penalty=1.3, logprobs=True,
                                                         top_logprobs=3))
    engine.step([(plain, len(prompt)), (penalised, len(prompt))])
    for _ in range(11):
        engine.step([(plain, 1), (penalised, 1)])
    assert penalised.token_ids[len(prompt):] == expected
    assert plain.token_ids[len(prompt):] != expected  # the penalty made a difference on this prompt


def _runner(path: Path, graphs: bool) -> ModelRunner:
    backend = ReplayingCpuBackend()
    model, spec = load_model(path, backend, DType.FLOAT32, "auto", 0)
    caches = backend.allocate_kv_cache(spec.num_layers, 32, 4, spec.num_kv_heads, spec.head_dim, DType.FLOAT32)
    if not graphs:
        return ModelRunner(model, backend, caches, 4, 8, "cpu")
    runner = GraphModelRunner(model, backend, caches, 4, 8, "cpu", capture_sizes=[1, 2, 4])
    runner.capture()
    return runner


def _decode(runner: ModelRunner, prompts: list[list[int]], samplings: list[Sampling], steps: int,
            stop: tuple[int, ...] = ()) -> tuple[list[list[int]], list]:
    seqs = [Sequence(i, list(p), 0, list(range(i * 8, i * 8 + 8)), s, stop_token_ids=stop)
            for i, (p, s) in enumerate(zip(prompts, samplings))]
    work = [ScheduledSeq(s, s.num_tokens) for s in seqs]
    tops = []
    for _ in range(steps):
        out = runner.execute(work)
        tops.append(out.top_logprobs)
        for s, item, tok in zip(seqs, work, out.token_ids):
            s.num_computed += item.num_new
            s.token_ids.append(tok)
        work = [ScheduledSeq(s, 1) for s in seqs]
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)], tops


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-pen")
    write_checkpoint(qwen3_config(tied=True), path)
    return path


def test_graph_runner_keeps_the_fast_path_unless_a_row_needs_processing(qwen_dir: Path) -> None:
    prompts = [[3, 5, 7, 9, 11], [20, 21], [40, 41, 42, 43]]
    plain = Sampling(temperature=0.9, top_k=20, seed=7, logprobs=True)  # chosen logprob: inside the graph
    runner = _runner(qwen_dir, graphs=True)
    _, tops = _decode(runner, prompts, [plain] * 3, steps=4)
    assert runner.graph_steps == 3 and all(t is None for t in tops)

    penalised = Sampling(temperature=0.9, top_k=20, seed=7, presence_penalty=1.0, frequency_penalty=0.5)
    samplings = [plain, penalised, plain]
    runner = _runner(qwen_dir, graphs=True)
    graph_tokens, _ = _decode(runner, prompts, samplings, steps=4)
    # one row with penalties: its decode steps replay the graphs that stop at the logits, then process and sample
    assert runner.graph_steps == runner.decode_logits_steps == 3 and runner.eager_steps == 1
    eager_tokens, _ = _decode(_runner(qwen_dir, graphs=False), prompts, samplings, steps=4)
    assert graph_tokens == eager_tokens

    # min_tokens needs the eager path only until enough tokens are out; then the graphs replay again
    runner = _runner(qwen_dir, graphs=True)
    greedy_min = Sampling(temperature=0.0, min_tokens=3)
    _decode(runner, prompts, [greedy_min] * 3, steps=6, stop=(1,))
    # steps 2 and 3 mask the stop id (fewer than min_tokens out) after a graph up to the logits; steps 4, 5, 6
    # sample tokens 4..6 inside the decode graphs
    assert (runner.graph_steps, runner.decode_logits_steps) == (5, 2)


def test_min_tokens_changes_a_greedy_stop(qwen_dir: Path) -> None:
    prompts = [[3, 5, 7, 9, 11]]
    runner = _runner(qwen_dir, graphs=False)
    free, _ = _decode(runner, prompts, [Sampling(temperature=0.0)], steps=5)
    stop = (free[0][1],)  # pretend the second greedy token is EOS
    masked, _ = _decode(runner, prompts, [Sampling(temperature=0.0, min_tokens=4)], steps=5, stop=stop)
    assert stop[0] not in masked[0][:4]
    if free[0][0] != stop[0]:
        assert masked[0][0] == free[0][0]  # nothing else changes


def test_seeded_sampling_with_penalties_is_independent_of_the_batch(qwen_dir: Path) -> None:
    p = Sampling(temperature=0.8, seed=7, repetition_penalty=1.2, frequency_penalty=0.3)
    other = Sampling(temperature=1.0, seed=99, presence_penalty=-0.5)
    alone, _ = _decode(_runner(qwen_dir, graphs=False), [[3, 5, 7]], [p], steps=6)
    batched, _ = _decode(_runner(qwen_dir, graphs=False), [[30, 31], [3, 5, 7], [8]], [other, p, other], steps=6)
    assert alone[0] == batched[1]


# ---------------------------------------------------------------- the wire on both sides


def test_worker_service_reads_prompt_len_and_stop_ids_and_returns_top_logprobs(qwen_dir: Path) -> None:
    service = WorkerService(_runner(qwen_dir, graphs=False))
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, min_tokens=5)
    # a re-admitted sequence: 3 prompt tokens + 2 generated before a preemption
    new = NewSeq(seq_id=1, token_ids=[3, 5, 7, 8, 9], num_computed=0, num_tokens=5, block_ids=[0, 1],
                 sampling=sampling, num_generated=2, stop_token_ids=[4])
    result = service.step(StepPlan(step=1, new_seqs=[new]))
    seq = service._seqs[1]
    assert seq.prompt_len == 3 and seq.stop_token_ids == (4,) and seq.num_generated == 3
    assert result.top_logprobs is not None and len(result.top_logprobs[0]) == 2
    assert result.top_logprobs[0][0][0] == result.token_ids[0]  # greedy: the top-1 is the sampled token
    assert result.logprobs is not None and result.logprobs[0] == pytest.approx(result.top_logprobs[0][0][1], abs=1e-5)


def test_scheduler_sends_min_tokens_stop_ids_and_passes_top_logprobs_through() -> None:
    eng = SchedulerEngine(num_blocks=16, block_size=4, max_model_len=64)
    eng.submit(Submit(request_id="a", prompt_token_ids=[1, 2, 3], max_tokens=8, stop_token_ids=[9, 7],
                      min_tokens=2, sampling=SamplingParams(logprobs=True, top_logprobs=2, min_tokens=2)))
    eng.submit(Submit(request_id="b", prompt_token_ids=[4, 5], max_tokens=8, stop_token_ids=[9],
                      sampling=SamplingParams()))
    plan = eng.plan_step()
    assert plan is not None
    assert [ns.stop_token_ids for ns in plan.new_seqs] == [[7, 9], []]
    sids = [ns.seq_id for ns in plan.new_seqs]
    outs = eng.apply_result(StepResult(step=1, seq_ids=sids, token_ids=[11, 12], logprobs=[-0.5, -0.25],
                                       top_logprobs=[[(11, -0.5), (13, -1.5)], []]))
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].logprobs == [-0.5] and by_id["a"].top_logprobs == [[(11, -0.5), (13, -1.5)]]
    assert by_id["b"].logprobs is None and by_id["b"].top_logprobs is None  # it did not ask
