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
