"""The scheduler (from the wire's SamplingParams) and the worker (from its domain Sequence, through the admission's
conversion) agree on which requests read their own output: a disagreement either stalls the batch (the worker
waits on a row the planner launched early) or masks with a stale grammar state."""

from __future__ import annotations

import itertools

from infer_protocol.messages import SamplingParams, StructuredOutput
from infer_worker.application.worker_service import to_sampling
from infer_worker.domain.sequence import Sequence


def test_scheduler_and_worker_apply_one_rule() -> None:
    seen = set()
    for presence, frequency, repetition, structured in itertools.product(
            (0.0, 0.5), (0.0, -0.3), (1.0, 1.2), (None, StructuredOutput(kind="json_object"))):
        wire = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                              repetition_penalty=repetition, structured=structured)
        seq = Sequence(seq_id=1, token_ids=[1, 2, 3], num_computed=0, block_ids=[0], sampling=to_sampling(wire))
        assert seq.reads_output == wire.reads_its_output, wire
        seen.add(wire.reads_its_output)
    assert seen == {True, False}
