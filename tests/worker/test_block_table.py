"""The persistent block table against a reference that rebuilds every step's table from the sequences' lists."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_backend_cpu import CpuBackend
from infer_protocol.messages import ContinueSeq, NewSeq, SamplingParams, StepPlan
from infer_worker.application.block_table import BlockTable, ScheduledBatch, contiguous_start
from infer_worker.application.graph_runner import _StaticBuffers
from infer_worker.application.model_runner import LaunchedStep, prepare_step, sampling_arrays
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import SampledTokens, ScheduledSeq, Sequence

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 4
MAX_BLOCKS = 6


def _reference(seqs: list[Sequence], width: int) -> np.ndarray:
    table = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, seq in enumerate(seqs):
        table[i, :len(seq.block_ids)] = seq.block_ids
    return table


# add: a new sequence with 0-3 blocks; append: 0-2 blocks to the i-th live one; remove: the i-th live one.
_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3)),
    st.tuples(st.just("append"), st.integers(0, 10**6), st.integers(0, 2)),
    st.tuples(st.just("remove"), st.integers(0, 10**6)),
    st.tuples(st.just("step"), st.randoms(use_true_random=False)),
), max_size=80)


class _Live:
    """The sequences the table holds, changed by the add / append / remove ops (block ids never reused)."""

    def __init__(self, table: BlockTable, max_blocks: int = 10**6) -> None:
        self.table, self.max_blocks = table, max_blocks
        self.seqs: list[Sequence] = []
        self.next_id = self.next_block = 0

    def _blocks(self, k: int) -> list[int]:
        self.next_block += k
        return list(range(self.next_block - k, self.next_block))

    def apply(self, op: tuple) -> None:
        if op[0] == "add":
            seq = Sequence(self.next_id, [1], 0, self._blocks(op[1]), GREEDY)
            self.next_id += 1
            self.table.add(seq)
            self.seqs.append(seq)
        elif op[0] == "append" and self.seqs:
            seq = self.seqs[op[1] % len(self.seqs)]
            new = self._blocks(min(op[2], self.max_blocks - len(seq.block_ids)))
            seq.block_ids.extend(new)
            self.table.append(seq, new)
        elif op[0] == "remove" and self.seqs:
            seq = self.seqs.pop(op[1] % len(self.seqs))
            self.table.remove(seq)
            assert seq.slot == -1 and not self.table.holds(seq)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, rows=st.integers(1, 4))
def test_random_interleavings_match_a_table_rebuilt_from_lists(ops: list[tuple], rows: int) -> None:
    table = BlockTable(rows=rows)  # few rows and no columns: growth is exercised too
    model = _Live(table)
    live = model.seqs
    for op in ops:
        model.apply(op)
        if op[0] == "step" and live:
            step = live.copy()
            op[1].shuffle(step)
            step = step[:op[1].randint(1, len(step))]
            slots = np.array([s.slot for s in step], dtype=np.int64)
            width = table.blocks.shape[1]
            assert np.array_equal(table.rows(slots), _reference(step, width))
        assert table.num_live == len(live)
        assert len({s.slot for s in live}) == len(live)
        # Every row nobody holds is all -1 (so `add` writes only the new sequence's blocks).
        held = np.zeros(len(table.blocks), dtype=bool)
        held[[s.slot for s in live]] = True
        assert (table.blocks[~held] == -1).all()
        assert np.array_equal(table.blocks[[s.slot for s in live]], _reference(live, table.blocks.shape[1]))


def test_contiguous_slots_give_a_view_and_others_a_copy() -> None:
    table = BlockTable(MAX_BLOCKS)
    seqs = [Sequence(i, [1], 0, [i], GREEDY) for i in range(4)]
    for seq in seqs:
        table.add(seq)
    assert [s.slot for s in seqs] == [0, 1, 2, 3]  # the lowest free slots
    assert np.shares_memory(table.rows(np.array([1, 2, 3])), table.blocks)
    assert not np.shares_memory(table.rows(np.array([3, 1])), table.blocks)
    table.remove(seqs[1])
    again = Sequence(9, [1], 0, [7, 8], GREEDY)
    table.add(again)  # a freed row is reused, fresh
    assert again.slot == 1 and table.rows(np.array([1])).tolist() == [[7, 8, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="already holds"):
        table.add(again)


def _prepare_both(scheduled: list[ScheduledSeq], table: BlockTable) -> None:
    """prepare_step from the table's rows and from the lists agree field by field."""
    fast = prepare_step(ScheduledBatch(scheduled, table), BLOCK, MAX_BLOCKS)
    slow = prepare_step(scheduled, BLOCK, MAX_BLOCKS)
    assert fast.table is table and slow.table is None and slow.slots is None
    assert fast.slots is not None and fast.slots.tolist() == [s.seq.slot for s in scheduled]
    for name, a, b in zip(fast._fields, fast, slow):
        if name in ("table", "slots"):
            continue
        if name == "block_tables":
            a, b = fast.host_block_tables(), slow.block_tables
            assert (fast.block_tables is None) == (contiguous_start(fast.slots) is None)
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b) and a.dtype == b.dtype, name
        else:
            assert a == b, name


class _CheckingExecutor:
    """Checks every step the service launches against the list-built reference; samples token 5."""

    def __init__(self) -> None:
        self.launches = 0
        self.steps = 0

    def launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep:
        assert isinstance(scheduled, ScheduledBatch)
        if scheduled:
            _prepare_both(list(scheduled), scheduled.table)
            self.steps += 1
        self.launches += 1
        seqs = [s.seq for s in scheduled if s.samples]
        return LaunchedStep(self.launches, seqs, done=SampledTokens([s.seq_id for s in seqs], [5] * len(seqs),
                                                                    [0.0] * len(seqs)))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_worker_service_keeps_the_table_in_step_with_its_plans(data: st.DataObject) -> None:
    """Random admissions, decodes with new blocks, finishes and preemptions (re-admitted later as new)."""
    executor = _CheckingExecutor()
    service = WorkerService(executor)
    live: dict[int, int] = {}  # seq id -> tokens it holds
    blocks: dict[int, int] = {}  # seq id -> blocks it holds
    next_id = 1
    for step in range(1, data.draw(st.integers(1, 25)) + 1):
        finished = data.draw(st.lists(st.sampled_from(sorted(live)), unique=True)) if live else []
        preempted = [s for s in data.draw(st.lists(st.sampled_from(sorted(live)), unique=True)) if s not in finished] \
            if live else []
        for sid in finished + preempted:
            del live[sid], blocks[sid]
        new_seqs = []
        readmit = preempted[:1]  # a preempted sequence comes back at once, under its old id, as a new sequence
        for sid in readmit + list(range(next_id, next_id + data.draw(st.integers(0, 3)))):
            n = data.draw(st.integers(1, MAX_BLOCKS * BLOCK - 4))
            live[sid], blocks[sid] = n, -(-n // BLOCK)
            new_seqs.append(NewSeq(seq_id=sid, token_ids=list(range(1, n + 1)), num_computed=0, num_tokens=n,
                                   block_ids=[100 * sid + b for b in range(blocks[sid])], sampling=GREEDY))
        next_id += len(new_seqs) - len(readmit)
        continuing = []
        for sid in sorted(set(live) - {n.seq_id for n in new_seqs}):
            if live[sid] + 1 > MAX_BLOCKS * BLOCK:
                continue
            live[sid] += 1
            grow = -(-live[sid] // BLOCK) - blocks[sid]
            continuing.append(ContinueSeq(sid, 1, [100 * sid + blocks[sid] + b for b in range(grow)]))
            blocks[sid] += grow
        service.launch(StepPlan(step=step, new_seqs=new_seqs, continuing=continuing, finished=finished,
                                preempted=preempted))
        service.collect()
        assert service._table.num_live == service.num_sequences == len(live)
    assert executor.steps >= 1 or not live


# ---------------------------------------------------------------- the graph runner's device copy


_MIRROR_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 3)),
    st.tuples(st.just("append"), st.integers(0, 10**6), st.integers(0, 2)),
    st.tuples(st.just("remove"), st.integers(0, 10**6)),
    st.tuples(st.just("step"), st.randoms(use_true_random=False)),
    st.tuples(st.just("new_table"),),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=_MIRROR_OPS)
def test_the_device_copy_gathers_the_rows_a_rebuilt_table_holds(ops: list[tuple]) -> None:
    """_StaticBuffers.load with a persistent table: the device block table (its sequence rows, then padding
    rows of 0) equals the list-built one after every step, through growth, slot reuse and a new table."""
    max_seqs, width = 4, 8
    buf = _StaticBuffers(max_seqs, max_seqs, width, "cpu", CpuBackend())
    model = _Live(BlockTable(rows=1), width)
    for op in ops:
        if op[0] == "new_table":
            model = _Live(BlockTable(rows=1), width)
        model.apply(op)
        table, live = model.table, model.seqs
        if op[0] == "step" and live:
            step_seqs = live.copy()
            op[1].shuffle(step_seqs)
            step_seqs = step_seqs[:op[1].randint(1, min(len(step_seqs), max_seqs))]
            for seq in step_seqs:  # one decode token at the end of the blocks it holds
                seq.token_ids = [1] * (len(seq.block_ids) * BLOCK)
                seq.num_computed = len(seq.token_ids) - 1
            step = prepare_step(ScheduledBatch([ScheduledSeq(s, 1) for s in step_seqs], table), BLOCK, width)
            assert step.table is table
            bucket = max_seqs if len(step_seqs) > 2 else 2
            buf.load(step, sampling_arrays(step.sampling_seqs), bucket, bucket)
            expected = np.zeros((bucket, width), dtype=np.int32)
            expected[:len(step_seqs)] = _reference(step_seqs, width)
            assert np.array_equal(buf.block_tables[:bucket].numpy(), expected)
