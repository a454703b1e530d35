"""Compatibility shims applied before the first Numba CUDA kernel is compiled.

numba-cuda 0.30.4 refers to `numpy.row_stack` while compiling a kernel; numpy 2.5 removed that alias
(it was deprecated in 2.0 as a plain synonym of `numpy.vstack`), so the first compile fails with
`AttributeError: module 'numpy' has no attribute 'row_stack'` on the H200 image (numba-cuda 0.30.4 with numpy 2.5).
Restoring the alias as `numpy.vstack` fixes it; on numpy versions that still have `row_stack` nothing is
changed.
"""

from __future__ import annotations

import numpy

_applied = False


def apply_numpy_compat() -> bool:
    """Install the missing numpy aliases numba-cuda needs. Idempotent; returns True when an alias was added
    by this call (False when numpy already had it or the shim was applied before)."""
    global _applied
    added = False
    if "row_stack" not in vars(numpy):
        numpy.row_stack = numpy.vstack
        added = True
    _applied = True
    return added


def compat_applied() -> bool:
    """Whether `apply_numpy_compat` has run in this process (it runs before any kernel compile)."""
    return _applied and "row_stack" in vars(numpy)
