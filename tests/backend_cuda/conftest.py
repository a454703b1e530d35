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


def _language_namespaces() -> list[object]:
    """What Triton's interpreter patches while it runs a kernel (`triton.runtime.interpreter._patch_lang`)."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.condition, tl.core.tensor_descriptor_base]


# Taken at collection, before any kernel has run under the interpreter.
_PRISTINE = [(owner, dict(vars(owner))) for owner in _language_namespaces()]


@pytest.fixture(autouse=True)
def pristine_triton_language() -> None:
    """Each test starts with `triton.language` as imported (`restore_triton_language`)."""
    restore_triton_language()


def restore_triton_language() -> None:
    """`triton.language` as imported. The interpreter (Triton 3.9) restores what a kernel launch patched, but not
    what a device-function call inside it patches: a standard-library helper such as `tl.cdiv` re-patches
    `triton.language.core` (its builtins wrapped to take the interpreter's semantic, `range`, `dtype.to_ir`) and
    leaves it so. A later compile for sm_90 in the same process (the Gluon prefill attention's tests, the SASS
    censuses) then builds through the interpreter and fails where Triton's cache does not already hold the kernel;
    with tests scheduled one by one over two workers, whether one had run before was luck."""
    for owner, names in _PRISTINE:
        current = vars(owner)
        for name in [n for n in current if n not in names and _from_interpreter(current[n])]:
            delattr(owner, name)  # added by a patch (submodules imported since are left alone)
        for name, value in names.items():
            if current.get(name, _MISSING) is not value:
                setattr(owner, name, value)


def _from_interpreter(value: object) -> bool:
    return getattr(value, "__module__", None) == "triton.runtime.interpreter"


_MISSING = object()


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=2e-4, rtol=2e-4),
        torch.float16: dict(atol=5e-3, rtol=5e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }[dtype]


class LaunchSpy:
    """Stands in for a jitted kernel (`monkeypatch.setattr(module, name, LaunchSpy(kernel))`): records each launch's
    keyword arguments, its constexprs among them, and launches the real kernel."""

    def __init__(self, kernel) -> None:  # noqa: ANN001 - a triton.JITFunction
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


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
