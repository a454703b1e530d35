"""Fault containment in one process: the real scheduler Engine drives the real WorkerService over the eager CPU
runner, and one step fails with a Python error — at launch (the test-only fault injection) or when its tokens
are collected (after, with the one-step-ahead pipeline, the next step was already launched with the same
sequences). Every request of the failed step ends with an error; the others, and requests after, get the tokens
of a run without the fault; the block accounting stays exact; the worker forgets the failed sequences."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest

from infer_protocol.messages import RequestError, SamplingParams, StepFailed, Submit
from infer_scheduler.engine import Engine
from infer_worker.application.fault_injection import FaultInjectingExecutor, InjectedFault, with_fault_injection
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from tests.worker.test_overlap_pipeline import BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, make_runner
from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint

FAULT = 249  # the poisoned token id
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-faults")
    write_checkpoint(qwen3_config(tied=True), path, seed=5)
    return path


class FailAtCollect:
    """Launches normally; the result of the step holding FAULT among the tokens it computes raises."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def launch(self, scheduled: list[ScheduledSeq]) -> Any:
        work = self._executor.launch(scheduled)
        if any(FAULT in s.seq.token_ids[s.seq.num_computed:s.seq.num_computed + s.num_new] for s in scheduled):
            def result() -> Any:
                raise InjectedFault("the result could not be read")

            work.result = result  # type: ignore[method-assign]
        return work


def submit(rid: str, prompt: list[int], max_tokens: int = 10) -> Submit:
    return Submit(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, max_tokens=max_tokens)


# A long-running request, the poisoned one (its 14 tokens take two chunks of 8; FAULT is in the second), and one
# after the failure that shares all but the last token of the poisoned prompt: the failed chunk's pages must not
# be served to it from the prefix cache.
LONG = submit("long", [3, 9, 27, 81, 50, 7, 11], max_tokens=30)
BAD_PROMPT = [20 + j for j in range(13)] + [FAULT]
BAD = submit("bad", BAD_PROMPT)
AFTER = submit("after", BAD_PROMPT[:-1] + [5, 6, 7])


def drive(service: WorkerService, engine: Engine, arrivals: dict[int, list[Submit]]
          ) -> tuple[dict[str, list[int]], dict[str, str], list[RequestError]]:
    """The scheduler and worker loops; `arrivals`: results applied -> requests submitted then."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    errors: list[RequestError] = []
    held: deque[Any] = deque()
    applied = 0
    for s in arrivals.get(0, []):
        assert engine.submit(s) is None
    while True:
        while engine.can_plan and (plan := engine.plan_step()) is not None:
            held.extend(service.launch(plan))
            while service.num_inflight > 1:
                held.append(service.collect())
        if not held and service.num_inflight:
            held.append(service.collect())
        if not held:
            if any(k > applied for k in arrivals):
                applied += 1
                for s in arrivals.get(applied, []):
                    assert engine.submit(s) is None
                continue
            return tokens, finish, errors
        result = held.popleft()
        if isinstance(result, StepFailed):
            errors.extend(engine.fail_step(result.step, result.message, code="step_failed"))
        else:
            for out in engine.apply_result(result):
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
                if out.finish_reason:
                    finish[out.request_id] = out.finish_reason
        engine.check_invariants()
        applied += 1
        for s in arrivals.get(applied, []):
            assert engine.submit(s) is None
        assert applied < 1000


def new_engine(overlap: bool) -> Engine:
    return Engine(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE * MAX_BLOCKS_PER_SEQ,
                  max_batch_tokens=24, chunked_prefill_size=8, max_inflight_steps=2 if overlap else 1,
                  vocab_size=256)


@pytest.mark.parametrize("where", ["launch", "collect"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_failed_step_fails_its_requests_only(model_dir: Path, overlap: bool, where: str) -> None:
    reference, _, none = drive(WorkerService(make_runner(model_dir, False, 64)), new_engine(overlap),
                               {0: [submit("after", AFTER.prompt_token_ids)]})
    assert not none
    runner = make_runner(model_dir, False, 64)
    executor = FaultInjectingExecutor(runner, FAULT) if where == "launch" else FailAtCollect(runner)
    service = WorkerService(executor)
    engine = new_engine(overlap)
    # long runs alone, bad arrives after its 3rd token (so the two share bad's steps), after comes once both ended
    tokens, finish, errors = drive(service, engine, {0: [LONG], 3: [BAD], 40: [AFTER]})
    failed = {e.request_id for e in errors}
    assert failed == {"bad", "long"}  # everything in the failed step fails (long was decoding in it)
    assert all(e.code == "step_failed" and "InjectedFault" in e.message and e.status == 500 for e in errors)
    assert "bad" not in finish and "long" not in finish
    assert len(tokens["long"]) >= 3  # what it had before the failure was delivered
    assert tokens["after"] == reference["after"] and finish["after"] == "length"
    assert engine.kv.num_free + engine.kv.num_cached == engine.kv.num_blocks
    assert not engine.has_work and not engine.in_flight


def test_the_worker_forgets_the_failed_sequences_and_serves_on(model_dir: Path) -> None:
    """Right after the failure the persistent batch holds none of the failed step's sequences, and the ids the
    scheduler still names in the one step planned before it learnt of the failure are skipped, not an error."""
    runner = make_runner(model_dir, False, 64)
    service = WorkerService(FaultInjectingExecutor(runner, FAULT))
    engine = new_engine(overlap=True)
    assert engine.submit(LONG) is None
    first = engine.plan_step()
    assert first is not None
    service.launch(first)
    assert engine.submit(BAD) is None
    second = engine.plan_step()
    assert second is not None and second.new_seqs  # bad's first chunk: no fault there yet
    service.launch(second)
    for result in [service.collect()]:
        engine.apply_result(result)
    while True:  # plan until the poisoned chunk fails
        plan = engine.plan_step()
        assert plan is not None
        service.launch(plan)
        out = service.collect()
        if isinstance(out, StepFailed):
            break
        engine.apply_result(out)
    assert sorted(out.seq_ids) == sorted(r.seq_id for r in engine.running)
    assert service.num_sequences == 0
    assert {e.request_id for e in engine.fail_step(out.step, out.message)} == {"long", "bad"}
    assert engine.submit(AFTER) is None
    while engine.has_work or engine.in_flight:
        plan = engine.plan_step()
        if plan is not None:
            service.launch(plan)
        engine.apply_result(service.collect())  # type: ignore[arg-type]
    assert service.num_sequences <= 1  # only "after", until a later plan names it finished


def test_fault_injection_is_off_unless_asked() -> None:
    sentinel = object()
    assert with_fault_injection(sentinel, None) is sentinel  # type: ignore[arg-type]
    assert with_fault_injection(sentinel, "") is sentinel  # type: ignore[arg-type]
    assert isinstance(with_fault_injection(sentinel, "17"), FaultInjectingExecutor)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a token id"):
        with_fault_injection(sentinel, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be one of python, device"):
        with_fault_injection(sentinel, "17", "disk")  # type: ignore[arg-type]


def test_a_device_fault_on_the_cpu_is_a_python_error_of_the_step() -> None:
    """The device kind gathers out of bounds on the backend's device: a device-side assert on a GPU
    (tests/gpu/test_device_fault_cuda.py), an IndexError on the CPU, which fails the step like any Python error."""
    injected = FaultInjectingExecutor(object(), 5, "device", "cpu")  # type: ignore[arg-type]
    seq = Sequence(0, [1, 5, 2], 0, [0], Sampling(temperature=0.0))
    with pytest.raises(IndexError):
        injected.launch([ScheduledSeq(seq, 3)])


def test_backends_classify_device_errors() -> None:
    from infer_backend_cpu import CpuBackend
    from infer_backend_cuda.backend import CudaBackend

    assert not CpuBackend().is_fatal_error(RuntimeError("CUDA error: device-side assert triggered"))
    cuda = CudaBackend.__new__(CudaBackend)  # no GPU needed: the classification reads only the exception
    assert cuda.is_fatal_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert cuda.is_fatal_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not cuda.is_fatal_error(ValueError("sequence 3 holds 9 blocks"))
    assert not cuda.is_fatal_error(RuntimeError("shape mismatch"))
    import torch

    if hasattr(torch, "AcceleratorError"):
        try:
            exc = torch.AcceleratorError("boom")  # type: ignore[call-arg]
        except TypeError:
            exc = None
        if exc is not None:
            assert cuda.is_fatal_error(exc)


def test_a_fatal_error_propagates(model_dir: Path) -> None:
    """What the backend calls fatal (a CUDA error) is not contained: it leaves the service, and the worker loop
    turns it into a fatal WorkerError and exits."""
    runner = make_runner(model_dir, False, 64)
    service = WorkerService(FaultInjectingExecutor(runner, FAULT), is_fatal=lambda exc: True)
    engine = new_engine(overlap=False)
    assert engine.submit(BAD) is None
    with pytest.raises(InjectedFault):
        while True:
            plan = engine.plan_step()
            assert plan is not None
            service.launch(plan)
            engine.apply_result(service.collect())  # type: ignore[arg-type]
