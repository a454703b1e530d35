"""InputUploader: a step's arrays (mixed dtypes, 2-D, empty) arrive intact through one packed copy, also when the
staging buffers and the device region have to grow, and the staging slots rotate."""

from __future__ import annotations

import numpy as np
import torch

from infer_backend_cpu import CpuBackend
from infer_worker.application.input_upload import SLOTS, InputUploader


def _arrays(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [
        rng.integers(-2**40, 2**40, size=n, dtype=np.int64),
        rng.integers(-2**30, 2**30, size=(n, 7), dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        rng.standard_normal(n + 3).astype(np.float32),
        rng.integers(0, 100, size=3, dtype=np.int32)[::2],  # not contiguous
    ]


def test_arrays_arrive_intact_with_growth_and_rotation() -> None:
    uploader = InputUploader(CpuBackend(), "cpu")
    rng = np.random.default_rng(3)
    for n in [5, 1, 3000, 17, 40_000, 2]:  # 40k int64 rows are beyond the first staging buffers: they grow
        arrays = _arrays(rng, n)
        got = uploader.upload(arrays)
        assert len(got) == len(arrays)
        for a, t in zip(arrays, got):
            assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(t.shape) == a.shape
            assert np.array_equal(t.numpy(), a)


def test_staging_slots_rotate() -> None:
    backend = CpuBackend()
    uploader = InputUploader(backend, "cpu")
    ring = uploader._ring
    taken = [ring.take(64).data_ptr() for _ in range(2 * SLOTS)]
    assert len(set(taken)) == SLOTS and taken[:SLOTS] == taken[SLOTS:]


class _Fence:
    """A device position the test controls: the copies before it have run once `passed` is set."""

    def __init__(self, log: list[str]) -> None:
        self.passed = False
        self._log = log

    def ready(self) -> bool:
        return self.passed

    def wait(self) -> list[torch.Tensor]:
        self._log.append("wait")
        self.passed = True  # a real wait returns once the device got there
        return []


class _LaggingBackend(CpuBackend):
    """The CPU backend, whose device-to-host transfers are fences the test inspects (a device running behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.fences: list[_Fence] = []

    def copy_to_host(self, tensors):  # type: ignore[no-untyped-def, override]
        assert not tensors, "only the staging fences ask for transfers here"
        self.fences.append(_Fence(self.log))
        self.log.append("fence")
        return self.fences[-1]


def test_a_staging_slot_is_rewritten_only_after_its_last_copy_ran() -> None:
    """A prefill chunk samples nothing, so the worker loop does not wait for it: the device can be SLOTS uploads
    behind. The next upload into a slot must first wait for that slot's previous copy."""
    backend = _LaggingBackend()
    uploader = InputUploader(backend, "cpu")
    rng = np.random.default_rng(5)
    for n in range(SLOTS):
        uploader.upload(_arrays(rng, n + 1))
    assert backend.log == ["fence"] * SLOTS and not any(f.passed for f in backend.fences)
    uploader.upload(_arrays(rng, 9))  # reuses slot 0: waits for the first upload's copy, and only for that one
    assert backend.log == ["fence"] * SLOTS + ["wait", "fence"]
    assert [f.passed for f in backend.fences] == [True] + [False] * (SLOTS - 1) + [False]


def test_the_graph_buffers_staging_waits_for_its_slots_last_copy_too() -> None:
    from infer_worker.application.graph_runner import _StaticBuffers
    from infer_worker.application.model_runner import prepare_step, sampling_arrays
    from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence

    backend = _LaggingBackend()
    buffers = _StaticBuffers(max_tokens=8, max_seqs=2, max_blocks_per_seq=4, device="cpu", backend=backend)
    seq = Sequence(0, [1, 2, 3], 0, [0], GREEDY)
    step = prepare_step([ScheduledSeq(seq, 3)], 16, 4)
    for _ in range(SLOTS):
        buffers.load(step, sampling_arrays(step.sampling_seqs), tokens=8, seqs=2)
    assert "wait" not in backend.log
    buffers.load(step, sampling_arrays(step.sampling_seqs), tokens=8, seqs=2)
    assert backend.log[-2:] == ["wait", "fence"] and backend.fences[0].passed
