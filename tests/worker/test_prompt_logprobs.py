"""Prompt logprobs: in the worker against HF transformers' log_softmax over the prompt, across prefill chunks and
next to a sequence that did not ask (the graph runner sends such steps down the eager path with the same result);
in the scheduler, gathered over the steps into the request's first output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer_protocol.messages import PromptLogprobs, SamplingParams, StepResult, Submit
from infer_scheduler.engine import Engine as SchedulerEngine
from infer_worker.application import prompt_logprobs
from infer_worker.application.model_runner import ModelRunner
from infer_worker.application.worker_service import to_sampling
from infer_worker.domain.sequence import GREEDY, Sampling, ScheduledSeq, Sequence
from tests.worker.test_logits_processing import _runner
from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint

PROMPT = [3, 17, 5, 9, 44, 2, 61, 7, 7, 30, 12]
OTHER = [8, 1, 22, 5, 6, 19]
ASKING = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, prompt_logprobs=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    path = tmp_path_factory.mktemp("qwen-prompt-lp")
    hf = write_checkpoint(qwen3_config(tied=True), path, seed=6)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].to(torch.float32)  # type: ignore[operator]
    return path, torch.log_softmax(logits, dim=-1)


def _run_chunked(runner: ModelRunner) -> list[PromptLogprobs]:
    """PROMPT in two chunks (5 + 6 tokens), each step beside a sequence that asks for nothing."""
    asking = Sequence(0, list(PROMPT), 0, list(range(0, 8)), to_sampling(ASKING))
    other = Sequence(1, list(OTHER), 0, list(range(8, 16)), GREEDY)
    out = []
    first = runner.execute([ScheduledSeq(other, len(OTHER)), ScheduledSeq(asking, 5)])
    out += first.prompt_logprobs
    asking.num_computed, other.num_computed = 5, len(OTHER)
    other.token_ids.append(first.token_ids[0])
    second = runner.execute([ScheduledSeq(other, 1), ScheduledSeq(asking, len(PROMPT) - 5)])
    out += second.prompt_logprobs
    assert second.seq_ids == [1, 0]  # both sample in the second step; the first logprobs came without a token
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_prompt_logprobs_equal_hf_log_softmax_across_chunks(checkpoint: tuple[Path, torch.Tensor],
                                                             graphs: bool) -> None:
    path, ref = checkpoint
    runner = _runner(path, graphs=graphs)
    chunks = _run_chunked(runner)
    assert [(c.seq_id, c.start, len(c.logprobs)) for c in chunks] == [(0, 1, 5), (0, 6, 5)]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top]
    want = [ref[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))]
    assert logprobs == pytest.approx(want, abs=2e-4)
    for p, top in enumerate(tops, start=1):
        values, ids = ref[p - 1].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-4)
    if graphs:
        assert runner.eager_steps == 2 and runner.graph_steps == 0  # type: ignore[attr-defined]


def test_slices_of_rows_give_the_same_logprobs(checkpoint: tuple[Path, torch.Tensor],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = checkpoint
    whole = _run_chunked(_runner(path, graphs=False))
    monkeypatch.setattr(prompt_logprobs, "_ROWS_PER_SLICE", 2)  # 5 rows per chunk: slices of 2, 2 and 1
    sliced = _run_chunked(_runner(path, graphs=False))
    assert [lp for c in sliced for lp in c.logprobs] == pytest.approx([lp for c in whole for lp in c.logprobs], abs=1e-6)
    assert [[t for t, _ in top] for c in sliced for top in c.top] == [[t for t, _ in top] for c in whole for top in c.top]


def test_a_sequence_that_does_not_ask_costs_nothing(checkpoint: tuple[Path, torch.Tensor]) -> None:
    path, _ = checkpoint
    runner = _runner(path, graphs=False)
    seq = Sequence(0, list(PROMPT), 0, list(range(0, 8)), Sampling(temperature=0.0, logprobs=True))
    assert runner.execute([ScheduledSeq(seq, len(PROMPT))]).prompt_logprobs == []


def test_scheduler_gathers_the_chunks_into_the_first_output_and_skips_the_prefix_cache() -> None:
    """The scheduler's side: chunks from several steps arrive on the request's first output, in order, and a
    request asking for prompt logprobs computes its whole prompt even when the prefix cache holds it."""
    eng = SchedulerEngine(num_blocks=32, block_size=4, max_model_len=64, chunked_prefill_size=6)
    prompt = list(range(1, 12))  # 11 tokens: chunks of 6 and 5
    eng.submit(Submit(request_id="warm", prompt_token_ids=prompt, max_tokens=1, sampling=SamplingParams()))
    for step in (1, 2):
        plan = eng.plan_step()
        assert plan is not None
        sampled = [c.seq_id for c in plan.continuing if c.num_tokens] if step == 2 else []
        eng.apply_result(StepResult(step=step, seq_ids=sampled, token_ids=[50] * len(sampled)))
    eng.submit(Submit(request_id="a", prompt_token_ids=prompt, max_tokens=2, sampling=ASKING))
    plan = eng.plan_step()
    assert plan is not None and plan.new_seqs[0].num_computed == 0 and plan.new_seqs[0].num_tokens == 6
    seq_id = plan.new_seqs[0].seq_id
    outs = eng.apply_result(StepResult(step=3, seq_ids=[], token_ids=[], prompt_logprobs=[
        PromptLogprobs(seq_id, 1, [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [[(7, -0.5)]] * 6)]))
    assert outs == []
    plan = eng.plan_step()
    assert plan is not None
    outs = eng.apply_result(StepResult(step=4, seq_ids=[seq_id], token_ids=[33], logprobs=[-0.25], prompt_logprobs=[
        PromptLogprobs(seq_id, 7, [-7.0, -8.0, -9.0, -10.0], [[(7, -0.5)]] * 4)]))
    first = outs[0].prompt_logprobs
    assert first is not None and first.start == 1 and first.logprobs == [-float(i) for i in range(1, 11)]
    assert outs[0].token_ids == [33] and outs[0].logprobs == [-0.25]
    plan = eng.plan_step()
    assert plan is not None
    outs = eng.apply_result(StepResult(step=5, seq_ids=[seq_id], token_ids=[34], logprobs=[-0.5]))
    assert outs[0].prompt_logprobs is None  # only the first output carries them
