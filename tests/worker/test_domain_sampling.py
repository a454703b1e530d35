"""The domain's `Sampling` mirrors the wire `SamplingParams`: a field added to one and not the other would be
silently dropped at admission, so the two are checked field for field."""

from __future__ import annotations

import dataclasses

from infer_protocol.messages import SamplingParams
from infer_worker.application.worker_service import to_sampling
from infer_worker.domain.sequence import Sampling


def test_sampling_has_every_wire_field_with_its_default() -> None:
    wire = SamplingParams()
    assert [f.name for f in dataclasses.fields(Sampling)] == list(SamplingParams.__struct_fields__)
    assert to_sampling(wire) == Sampling()


def test_to_sampling_copies_every_field() -> None:
    wire = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=42, logprobs=True, top_logprobs=3,
                          presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=4,
                          logit_bias=((1, 2.0),), allowed_token_ids=(1, 3), prompt_logprobs=True)
    assert dataclasses.astuple(to_sampling(wire)) == tuple(getattr(wire, f) for f in SamplingParams.__struct_fields__)
