"""A Triton compile after start-up is logged with the kernel's name, its time and whether the disk cache had it."""

from __future__ import annotations

import logging

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from infer_backend_cuda import compile_watch
from tests.backend_cuda.conftest import gpu


@pytest.fixture
def fresh_watch(monkeypatch):  # noqa: ANN001, ANN201
    """`watch` as in a new worker: no watch yet, no listener; both restored afterwards."""
    monkeypatch.setattr(compile_watch, "_WATCH", None)
    monkeypatch.setattr(knobs.compilation, "listener", None)
    return compile_watch


def _times(ir_us: int, stages_us: list[int], store_us: int) -> knobs.CompileTimes:
    return knobs.CompileTimes(ir_initialization=ir_us, lowering_stages=[(f"s{i}", d) for i, d in enumerate(stages_us)],
                              store_results=store_us)


def test_a_compile_heard_of_is_logged_and_counted(fresh_watch, caplog) -> None:  # noqa: ANN001
    watch = fresh_watch.watch()
    assert knobs.compilation.listener is watch and fresh_watch.watch() is watch  # installed once
    with caplog.at_level(logging.WARNING, logger=compile_watch.log.name):
        # Triton's call: listener(src=..., metadata=..., metadata_group=..., times=..., cache_hit=...)
        watch(src=None, metadata={"name": "_decode_split_kernel"}, metadata_group={},
              times=_times(200_000, [900_000, 400_000], 100_000), cache_hit=False)
        watch(src=None, metadata={"name": "_merge_kernel"}, metadata_group={}, times=_times(3_000, [], 0),
              cache_hit=True)
    assert fresh_watch.compiles_while_serving() == [
        compile_watch.Compile("_decode_split_kernel", 1.6, False), compile_watch.Compile("_merge_kernel", 0.003, True)]
    assert "compiled while serving (1.600 s" in caplog.text and "_decode_split_kernel" in caplog.text
    assert "loaded from the disk cache while serving (0.003 s" in caplog.text


def test_timings_of_another_form_never_fail_the_compile(fresh_watch) -> None:  # noqa: ANN001
    watch = fresh_watch.watch()
    watch(src=None, metadata={"name": "k"}, metadata_group={}, times=object(), cache_hit=False)
    [event] = fresh_watch.compiles_while_serving()
    assert event.kernel == "k" and event.seconds != event.seconds  # nan: unknown, still logged


def test_a_listener_someone_else_set_is_left_in_place(fresh_watch, monkeypatch) -> None:  # noqa: ANN001
    def theirs(**_: object) -> None:
        return None

    monkeypatch.setattr(knobs.compilation, "listener", theirs)
    fresh_watch.watch()
    assert knobs.compilation.listener is theirs
    assert fresh_watch.compiles_while_serving() == []


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@gpu
def test_a_new_variant_compiled_on_the_gpu_is_heard_of(fresh_watch) -> None:  # noqa: ANN001
    fresh_watch.watch()
    x = torch.zeros(100, device="cuda")
    _add_one[(2,)](x, 100, BLOCK=64)  # first met here: compiled (or loaded from Triton's disk cache)
    _add_one[(2,)](x, 100, BLOCK=64)
    assert torch.equal(x.cpu(), torch.full((100,), 2.0))
    [event] = fresh_watch.compiles_while_serving()
    assert event.kernel == "_add_one" and event.seconds >= 0


@gpu
def test_the_backend_starts_watching_when_serving_starts(fresh_watch) -> None:  # noqa: ANN001
    from infer_backend_cuda import CudaBackend

    CudaBackend(device="").serving_started()
    assert knobs.compilation.listener is compile_watch.watch()


def test_the_sampler_warm_up_covers_every_merge_variant_a_gpu_meets(monkeypatch) -> None:  # noqa: ANN001
    """One warmed chunk count per merge-kernel variant (padded width, Triton's integer classes) of 1..4096 rows, on
    a 132-SM GPU's chunk rule: 33 rows (32 chunks, a multiple of 16) was compiled while serving on the H100."""
    from infer_backend_cuda import numba_kernels as N

    monkeypatch.setattr(N, "_num_sms", lambda index: 132)
    monkeypatch.setattr(N, "simulator_enabled", lambda: False)
    gpu_device = torch.device("cuda", 0)
    warmed = N.merge_warm_chunks(gpu_device)
    met = {N.merge_variant(N.choose_chunks(n, N.WARM_VOCAB, gpu_device)) for n in range(1, 4097)}
    assert {N.merge_variant(c) for c in warmed} == met
    assert len(warmed) == len(met)  # one launch a variant
    assert N.merge_variant(N.choose_chunks(33, N.WARM_VOCAB, gpu_device)) in {N.merge_variant(c) for c in warmed}
    assert N.merge_variant(32) != N.merge_variant(31) and N.merge_variant(1) != N.merge_variant(2)


@gpu
def test_no_merge_variant_is_compiled_while_serving_after_the_warm_up(fresh_watch) -> None:  # noqa: ANN001
    """After the sampler's warm-up, merges of any batch size at a model's vocabulary (divisible by 16 or not)
    compile nothing."""
    from infer_backend_cuda import numba_kernels as N

    dev = torch.device("cuda", torch.cuda.current_device())
    N.warmup(dev)
    fresh_watch.watch()
    for vocab in (151936, 32001):
        for n in (1, 17, 33, 34, 66, 100, 133, 264):
            chunks = N.choose_chunks(n, vocab, dev)
            logits = torch.zeros((n, vocab), device=dev)
            parts = (torch.zeros((n, chunks), dtype=torch.float64, device=dev),
                     torch.zeros((n, chunks), dtype=torch.int64, device=dev),
                     torch.zeros((n, chunks), device=dev), torch.ones((n, chunks), device=dev))
            N.merge_partials(logits, *parts)
    torch.cuda.synchronize()
    assert [e for e in fresh_watch.compiles_while_serving() if e.kernel == "_merge_kernel"] == []
