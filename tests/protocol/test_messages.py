from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer_protocol import codec
from infer_protocol import messages as m

ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=20)
sampling = st.builds(
    m.SamplingParams,
    temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(0, 100), seed=st.integers(0, 2**62),
)


@given(st.text(max_size=10), ids, sampling, st.integers(1, 10_000))
def test_submit_round_trip(rid: str, prompt: list[int], params: m.SamplingParams, max_tokens: int) -> None:
    c = codec.server_to_scheduler()
    msg = m.Submit(request_id=rid, prompt_token_ids=prompt, sampling=params, max_tokens=max_tokens)
    assert c.decode(c.encode(msg)) == msg


@given(st.integers(0, 10**9), ids, ids)
def test_step_plan_round_trip(step: int, tokens: list[int], blocks: list[int]) -> None:
    c = codec.scheduler_to_worker()
    plan = m.StepPlan(
        step=step,
        new_seqs=[m.NewSeq(seq_id=1, token_ids=tokens, num_computed=0, num_tokens=len(tokens), block_ids=blocks,
                           sampling=m.SamplingParams())],
        continuing=[m.ContinueSeq(2, 1, blocks)],
        finished=[3],
        preempted=[4],
    )
    assert c.decode(c.encode(plan)) == plan


@pytest.mark.parametrize(
    "msg",
    [
        m.TokenBatch(step=3, outputs=[m.TokenOutput("r", [1, 2], [-0.5, -0.1], "stop", 4, 0)]),
        m.RequestError(request_id="r", code="worker_lost", message="gone", status=503),
        m.Pong(ready=True, stats=m.SchedulerStats(num_running=2), model=m.ModelInfo("/m", 2048, 100, "cpu", "cpu", "float32")),
    ],
)
def test_scheduler_to_server_round_trip(msg: object) -> None:
    c = codec.scheduler_to_server()
    assert c.decode(c.encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        m.StepResult(step=1, seq_ids=[1], token_ids=[5], logprobs=[-0.1]),
        m.StepResult(step=2, seq_ids=[], token_ids=[], grammars_ready=[3, 4]),
        m.GrammarStatus(ready=[1], errors=[m.SeqError(2, "grammar_too_complex", "too slow")]),
        m.Ready(num_blocks=10, block_size=16, model=m.ModelInfo("/m", 2048, 100, "cpu", "cpu", "float32")),
        m.Heartbeat(),
        m.Progress(status="loading"),
        m.WorkerError(fatal=True, message="boom"),
    ],
)
def test_worker_to_scheduler_round_trip(msg: object) -> None:
    c = codec.worker_to_scheduler()
    assert c.decode(c.encode(msg)) == msg


def test_messages_are_tagged_and_unknown_tags_are_refused() -> None:
    raw = msgspec.msgpack.encode({"type": "ping", "version": m.PROTOCOL_VERSION})
    assert codec.server_to_scheduler().decode(raw) == m.Ping()
    with pytest.raises(msgspec.ValidationError):
        codec.server_to_scheduler().decode(msgspec.msgpack.encode({"type": "launch_missiles"}))
    # A message of another direction is refused too: the unions are per channel.
    with pytest.raises(msgspec.ValidationError):
        codec.server_to_scheduler().decode(codec.worker_to_scheduler().encode(m.Heartbeat()))


def test_images_round_trip_in_submit_and_new_seq() -> None:
    image = m.ImageInput(offset=3, num_tokens=2, grid_thw=(1, 2, 4), patches=bytes(range(192)),
                         shape=(8, 24), value_table=bytes(range(256)) * 12, content_hash="ab" * 16)
    submit = m.Submit(request_id="r", prompt_token_ids=[1, 2, 3, 9, 9, 4], sampling=m.SamplingParams(), max_tokens=2,
                      images=[image])
    c = codec.server_to_scheduler()
    assert c.decode(c.encode(submit)) == submit
    plan = m.StepPlan(step=1, new_seqs=[m.NewSeq(seq_id=1, token_ids=[1, 2, 3, 9, 9, 4], num_computed=0, num_tokens=6,
                                                 block_ids=[0], sampling=m.SamplingParams(), images=[image])])
    w = codec.scheduler_to_worker()
    decoded = w.decode(w.encode(plan))
    assert decoded == plan and decoded.new_seqs[0].images[0].patches == image.patches
