"""The numpy shim numba-cuda 0.30.4 needs under numpy 2.5 (`numpy.row_stack` removed): applied before the
first kernel compile, idempotent and harmless."""

from __future__ import annotations

import warnings

import numpy
import pytest

from infer_backend_cuda import numba_compat, numba_kernels


def test_shim_restores_a_missing_row_stack(monkeypatch):
    monkeypatch.delattr(numpy, "row_stack", raising=False)  # what numpy 2.5 looks like
    assert not hasattr(numpy, "row_stack")
    assert numba_compat.apply_numpy_compat() is True
    assert numpy.row_stack is numpy.vstack
    assert numba_compat.apply_numpy_compat() is False  # idempotent
    a, b = numpy.arange(3), numpy.arange(3, 6)
    assert (numpy.row_stack([a, b]) == numpy.vstack([a, b])).all()


def test_shim_keeps_an_existing_row_stack(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(numpy, "row_stack", sentinel, raising=False)
    assert numba_compat.apply_numpy_compat() is False
    assert numpy.row_stack is sentinel


def test_shim_is_applied_before_kernels_compile_and_is_harmless():
    numba_kernels.get_sample_partials_kernel()
    assert numba_compat.compat_applied()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out = numpy.row_stack([numpy.ones(2), numpy.zeros(2)])
    assert out.shape == (2, 2) and out[0].tolist() == [1.0, 1.0]
    # numpy itself still works as before
    assert numpy.vstack([numpy.ones(2)]).shape == (1, 2)


def test_shim_runs_before_numba_import_in_kernel_module():
    """numba_kernels imports numba only through `_cuda()`, which applies the shim first."""
    import inspect

    src = inspect.getsource(numba_kernels._cuda)
    assert src.index("apply_numpy_compat()") < src.index("from numba import cuda")
    pytest.importorskip("numba")
