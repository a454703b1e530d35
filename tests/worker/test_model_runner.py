"""ModelRunner: step bookkeeping (positions, slots, pages, sampling rows), sampling and no mutation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer_worker.application.model_runner import prepare_step, sampling_arrays
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from tests.worker.tiny_checkpoints import Engine, llama_config, write_checkpoint

GREEDY = Sampling(temperature=0.0)


def _seq(seq_id: int, num_tokens: int, num_computed: int, block_ids: list[int],
         sampling: Sampling = GREEDY) -> Sequence:
    return Sequence(seq_id, [10 * seq_id + i for i in range(num_tokens)], num_computed, block_ids, sampling)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(llama_config(), path, seed=11)
    return path


# ---------------------------------------------------------------- bookkeeping


def test_prepare_step_for_a_mixed_ragged_batch() -> None:
    block_size = 4
    prefill = _seq(1, 6, 0, [7, 2])  # fresh prompt of 6 over pages 7, 2
    chunk = _seq(2, 10, 3, [5, 0, 9])  # resumes at position 3, computes 4 of 10 known tokens (mid-prefill)
    decode = _seq(3, 9, 8, [4, 8, 6])  # one decode token at position 8 (page 6, offset 0)
    step = prepare_step([ScheduledSeq(prefill, 6), ScheduledSeq(chunk, 4), ScheduledSeq(decode, 1)], block_size, 5)
    assert step.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 23, 24, 25, 26, 38]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 8]
    assert step.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 23, 0, 1, 2, 24]
    assert step.query_start_loc.tolist() == [0, 6, 10, 11] and step.query_start_loc.dtype == np.int32
    assert step.seq_lens.tolist() == [6, 7, 9] and step.seq_lens.dtype == np.int32
    assert step.block_tables.tolist() == [[7, 2, -1, -1, -1], [5, 0, 9, -1, -1], [4, 8, 6, -1, -1]]
    assert (step.max_query_len, step.max_seq_len, step.is_decode) == (6, 9, False)
    assert step.sample_rows.tolist() == [5, 10]  # the mid-prefill chunk does not sample
    assert [s.seq_id for s in step.sampling_seqs] == [1, 3]


def test_prepare_step_decode_flag_and_sampling_positions() -> None:
    a = _seq(1, 5, 4, [0, 1], Sampling(temperature=0.8, top_p=0.9, top_k=40, min_p=0.1, seed=2**63 + 5))
    b = _seq(2, 3, 2, [3])
    step = prepare_step([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], 4, 2)
    assert step.is_decode and step.sample_rows.tolist() == [0, 1]
    arrays = sampling_arrays(step.sampling_seqs)
    assert arrays["positions"].tolist() == [5, 3]  # the index of the token about to be sampled
    assert arrays["seeds"].tolist() == [5, 0]  # the low 32 bits the counter hash reads
    assert arrays["top_k"].tolist() == [40, 0] and arrays["temperature"].tolist() == pytest.approx([0.8, 0.0])


@pytest.mark.parametrize(
    "seq,num_new,message",
    [
        (_seq(1, 9, 0, [0, 1]), 9, "holds 2 blocks; it needs 3"),  # pages do not cover the tokens
        (_seq(1, 4, 2, [0]), 3, "cannot compute 3 tokens from 2 with 4 known"),  # beyond the known tokens
        (_seq(1, 4, 0, [0]), 0, "cannot compute 0 tokens"),
        (_seq(1, 40, 0, list(range(10))), 40, "at most 8"),  # longer than the block table
    ],
)
def test_prepare_step_refuses_inconsistent_work(seq: Sequence, num_new: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_step([ScheduledSeq(seq, num_new)], 4, 8)


# ---------------------------------------------------------------- execute


def test_execute_samples_in_step_order_and_mutates_nothing(model_dir: Path) -> None:
    engine = Engine.open(model_dir)
    runner = engine.runner
    done = _seq(1, 6, 0, [10, 11])
    mid = _seq(2, 9, 0, [12, 13, 14])
    other = _seq(3, 3, 0, [15])
    before = [(s.token_ids.copy(), s.num_computed, s.block_ids.copy()) for s in (done, mid, other)]
    out = runner.execute([ScheduledSeq(other, 3), ScheduledSeq(mid, 5), ScheduledSeq(done, 6)])
    assert out.seq_ids == [3, 1]
    assert len(out.token_ids) == len(out.logprobs) == 2
    assert all(0 <= t < 256 for t in out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)
    assert [(s.token_ids, s.num_computed, s.block_ids) for s in (done, mid, other)] == before
    assert runner.execute([ScheduledSeq(mid, 4)]).seq_ids == []  # a prefill chunk alone samples nothing
    assert runner.execute([]).seq_ids == []


def test_seeded_sampling_does_not_depend_on_batch_neighbours(model_dir: Path) -> None:
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=1234)
    prompt = [9, 8, 7, 6, 5, 4, 3]

    def generate(with_neighbours: bool) -> list[int]:
        engine = Engine.open(model_dir)
        seq = engine.new_seq(0, prompt, sampling)
        neighbours = [engine.new_seq(i, [i] * (3 + i), Sampling(temperature=0.7, seed=i)) for i in (1, 2)]
        engine.step([(seq, len(prompt))] + ([(n, n.num_tokens) for n in neighbours] if with_neighbours else []))
        engine.decode([*neighbours, seq] if with_neighbours else [seq], 11)
        return seq.token_ids[len(prompt):]

    alone, crowded = generate(False), generate(True)
    assert alone == crowded and len(alone) == 12
    assert len(set(alone)) > 1  # a real draw, not a constant


def test_dummy_run_goes_through_the_real_path(model_dir: Path) -> None:
    engine = Engine.open(model_dir, num_blocks=8)
    out = engine.runner.dummy_run(num_tokens=13, num_seqs=2)
    assert out.seq_ids == [-1, -2] and len(out.token_ids) == 2
    with pytest.raises(ValueError, match="cache blocks"):
        engine.runner.dummy_run(num_tokens=40)
