"""Fixtures for the CUDA adapter's kernel tests.

Without a GPU the suite-wide conftest has switched on TRITON_INTERPRET / NUMBA_ENABLE_CUDASIM, so the same
launchers run on CPU tensors; shapes for that mode are small. Larger shapes are marked `gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=2e-4, rtol=2e-4),
        torch.float16: dict(atol=5e-3, rtol=5e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }[dtype]


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a float output buffer with NaN (integer buffers with -7) before a kernel runs."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


def committed_table_entries(path: Path) -> list[dict]:
    """Every entry of a committed per-GPU tuned table (`configs/<kernel>.json`), each GPU's list non-empty; the test
    is skipped where no table is committed."""
    if not path.exists():
        pytest.skip("no tuned table committed")
    table = json.loads(path.read_text())
    assert table, "an empty table file"
    for device_name, entries in table.items():
        assert entries, device_name
    return [e for entries in table.values() for e in entries]
