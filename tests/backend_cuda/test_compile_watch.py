"""A Triton compile after start-up is logged with the kernel's name and how long running requests waited."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from infer_backend_cuda import compile_watch
from tests.backend_cuda.conftest import gpu


@pytest.fixture
def fresh_watch(monkeypatch):  # noqa: ANN001, ANN201
    """`watch` as in a new worker: no watch yet, Triton's hooks unset; both restored afterwards."""
    monkeypatch.setattr(compile_watch, "_WATCH", None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    return compile_watch


def test_a_compile_seen_between_the_hooks_is_logged_and_counted(fresh_watch, caplog) -> None:  # noqa: ANN001
    watch = fresh_watch.watch()
    assert knobs.runtime.jit_cache_hook == watch.before and knobs.runtime.jit_post_compile_hook == watch.after
    assert fresh_watch.watch() is watch  # once
    fn = types.SimpleNamespace(name="_decode_split_kernel")  # what Triton passes: JitFunctionInfo(module, name, fn)
    with caplog.at_level(logging.WARNING, logger=compile_watch.log.name):
        assert watch.before(fn=fn, key=None, repr="r", compile={}, is_manual_warmup=False,
                            already_compiled=False) is False  # the compile goes ahead
        watch.after(fn=fn, key=None, repr="_decode_split_kernel[num_warps=4](...)", compile={},
                    is_manual_warmup=False, already_compiled=False)
    [(name, seconds)] = fresh_watch.compiles_while_serving()
    assert name == "_decode_split_kernel" and 0 <= seconds < 5
    assert "compiled while serving" in caplog.text and "_decode_split_kernel[num_warps=4]" in caplog.text


def test_hooks_someone_else_set_are_left_in_place(fresh_watch, monkeypatch) -> None:  # noqa: ANN001
    def theirs(**_: object) -> None:
        return None

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", theirs)
    fresh_watch.watch()
    assert knobs.runtime.jit_post_compile_hook is theirs and knobs.runtime.jit_cache_hook is None
    assert fresh_watch.compiles_while_serving() == []


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@gpu
def test_a_new_variant_compiled_on_the_gpu_is_seen(fresh_watch) -> None:  # noqa: ANN001
    fresh_watch.watch()
    x = torch.zeros(100, device="cuda")
    _add_one[(2,)](x, 100, BLOCK=64)  # first met here: compiled (or loaded from Triton's disk cache)
    _add_one[(2,)](x, 100, BLOCK=64)
    assert torch.equal(x.cpu(), torch.full((100,), 2.0))
    assert [name for name, _ in fresh_watch.compiles_while_serving()] == ["_add_one"]


@gpu
def test_the_backend_starts_watching_when_serving_starts(fresh_watch) -> None:  # noqa: ANN001
    from infer_backend_cuda import CudaBackend

    CudaBackend(device="").serving_started()
    assert knobs.runtime.jit_post_compile_hook == compile_watch.watch().after
