"""The split-K fix-up (`kernels/split_k.py`; the AWQ kernels' sum, the reduce launch the mid and FP8 GEMMs';
`INFER_CUDA_SPLIT_K_FIXUP=1` / `0` forces one for all): the last program of a tile sums the partials in split order
instead of the reduce launch. Each split-K kernel (the AWQ GEMV, the AWQ tiled kernel, the FP8 kernel in both
product forms) must give the reduce path's output bit for bit with the fix-up forced, leave its arrival counters at
0, and give the same output twice in a row. Interpreter shapes are tiny; Qwen3-4B shapes and
a CUDA-graph capture with replays are marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.kernels import awq_gemm as A, fp8_gemm as F8, mid_gemm as G, split_k
from tests.backend_cuda.conftest import gpu, needs_cuda, poison
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, awq_operands, fp8_operands

# (kernel, rows, config): odd row counts and partial row tiles on every product path; N = 72 (AWQ) and 60 (FP8)
# below end in a partial column tile at every block_n here; several split counts
CASES = [
    ("awq-gemv", 1, A.AwqConfig(1, 16, 16, 2, 1, 2)),
    ("awq-gemv", 3, A.AwqConfig(4, 16, 16, 2, 1, 3)),
    ("awq-gemv", 7, A.AwqConfig(8, 256, 16, 2, 1, 8)),
    ("awq-gemv-long", 1, A.AwqConfig(1, 16, 16, 2, 1, 21)),  # 21 ranges: the sum's chunks of 16 and a short one
    ("awq-tiled", 5, A.AwqConfig(16, 16, 16, 4, 1, 3)),
    ("awq-tiled", 19, A.AwqConfig(16, 32, 16, 4, 1, 5)),
    ("fp8-rows", 1, F8.Fp8Config(1, 32, 4, 1, 2)),
    ("fp8-rows", 3, F8.Fp8Config(4, 16, 2, 1, 4)),
    ("fp8-tiles", 19, F8.Fp8Config(16, 16, 4, 1, 3)),
]


def _gemm(kind: str, m: int, dtype: torch.dtype, device: str, with_bias: bool):
    """A closure `run(out, config)` over one operand set, and the output width."""
    if kind.startswith("awq"):
        n, k = 72, 21 * 64 if kind.endswith("long") else 256
        operands = awq_operands(n, k, 64, device, seed=m)
    else:
        n, k = 60, 200  # parts of 40 and 20 rows in blocks of 16; K = 200 in groups of 64: a partial last group
        operands = fp8_operands([40, 20], k, (16, 64), device, seed=m)
    bias = activations(n, 1, torch.float32, device, 7).reshape(n).to(dtype) if with_bias else None
    x = activations(m, k, dtype, device)

    def run(out, config):
        if kind.startswith("awq"):
            return A.awq_linear(x, *operands, bias, out=out, config=config)
        return F8.fp8_block_linear(x, *operands, 64, bias, out=out, config=config)

    return run, n


def _reduce_launches(monkeypatch) -> list[int]:
    calls: list[int] = []
    reduce = split_k.reduce_splits

    def spy(ws, bias, out):
        calls.append(ws.shape[0])
        reduce(ws, bias, out)

    monkeypatch.setattr(split_k, "reduce_splits", spy)
    return calls


def _counters_zero(device: str) -> bool:
    counters = split_k.counters(torch.device(device))
    return counters is not None and not counters.any().item()


# Each case in both output dtypes and both bias states, paired rather than crossed (the fix-up's dtype and bias
# paths are independent epilogue steps; the cross product doubled this module's interpreter time, ~90 s in CI).
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("kind,m,config", CASES)
def test_fixup_equals_the_reduce_kernel_bit_for_bit(kind, m, config, dtype, with_bias, device, monkeypatch):
    run, n = _gemm(kind, m, dtype, device, with_bias)
    launches = _reduce_launches(monkeypatch)
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", False)
    reduced = run(poison(torch.empty((m, n), dtype=dtype, device=device)), config)
    assert len(launches) == 1 and launches[0] > 1  # the reference path did split and reduce

    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    first = run(poison(torch.empty((m, n), dtype=dtype, device=device)), config)
    assert len(launches) == 1  # no reduce launch with the fix-up
    assert _counters_zero(device)
    second = run(poison(torch.empty((m, n), dtype=dtype, device=device)), config)
    assert _counters_zero(device)
    assert torch.equal(first, reduced) and torch.equal(second, reduced)


def test_the_switch_forces_one_sum_or_leaves_each_kernel_its_own():
    assert split_k.fixup_override({}) is None and split_k.fixup_override({split_k.FIXUP_ENV: " "}) is None
    assert split_k.fixup_override({split_k.FIXUP_ENV: "1"}) is True
    assert split_k.fixup_override({split_k.FIXUP_ENV: "0"}) is False
    with pytest.raises(ValueError, match="INFER_CUDA_SPLIT_K_FIXUP='yes': expected 1"):
        split_k.fixup_override({split_k.FIXUP_ENV: "yes"})


@pytest.mark.parametrize("kind,m,config,fixup", [
    ("awq-gemv", 3, A.AwqConfig(4, 16, 16, 2, 1, 3), True),
    ("awq-tiled", 19, A.AwqConfig(16, 32, 16, 4, 1, 5), True),
    ("fp8-rows", 3, F8.Fp8Config(4, 16, 2, 1, 4), False),
    ("fp8-tiles", 19, F8.Fp8Config(16, 16, 4, 1, 3), False),
    ("mid", 20, G.MidConfig(16, 32, 4, 1, 4), False),
])
def test_each_kernel_sums_its_own_way_unless_forced(kind, m, config, fixup, device, monkeypatch):
    """Unforced, the AWQ kernels sum by the fix-up and the FP8 and mid GEMMs by the reduce launch (H100, thirty-second
    session); forced, every kernel the forced way, with the same bits."""
    if kind == "mid":
        x, w = activations(m, 256, torch.float32, device), activations(40, 256, torch.float32, device, 3)

        def run(out, config):
            return G.mid_linear(x, w, out=out, config=config)
    else:
        run, _ = _gemm(kind, m, torch.float32, device, True)
    split_k.allocate_counters(torch.device(device))
    launches = _reduce_launches(monkeypatch)
    results = []
    for forced, reduce_launches in ((None, 0 if fixup else 1), (True, 0), (False, 1)):
        monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", forced)
        launches.clear()
        results.append(run(None, config))
        assert len(launches) == reduce_launches, (forced, launches)
        assert _counters_zero(device)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_one_range_and_too_many_tiles_keep_the_plain_paths(device, monkeypatch):
    """K not split: no workspace, no counters. More tiles than counters: the reduce kernel, the same output."""
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    out = torch.empty((1, 8), device=device)
    one = split_k.partials(1, 1, 8, out, 3, fixup=True)
    assert one.workspace is out and not one.partial and not one.fixup
    run, n = _gemm("awq-gemv", 3, torch.float32, device, True)
    config = A.AwqConfig(4, 16, 16, 2, 1, 3)
    fixed = run(None, config)
    launches = _reduce_launches(monkeypatch)
    monkeypatch.setattr(split_k, "COUNTERS", 4)  # 72 columns at 16 are 5 tiles
    assert torch.equal(run(None, config), fixed) and launches == [2]  # 4 groups in ranges of 2


def test_counters_are_never_allocated_off_or_under_capture(device, monkeypatch):
    monkeypatch.setattr(split_k, "_counters", {})
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", False)
    assert split_k.allocate_counters(torch.device(device)) is None  # the switch is off
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    monkeypatch.setattr(split_k, "_capturing", lambda _device: True)
    out = torch.empty((1, 8), device=device)
    p = split_k.partials(2, 1, 8, out, 1, fixup=True)
    assert p.partial and not p.fixup and split_k.counters(torch.device(device)) is None
    monkeypatch.setattr(split_k, "_capturing", lambda _device: False)
    assert split_k.partials(2, 1, 8, out, 1, fixup=True).fixup
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", None)
    assert not split_k.partials(2, 1, 8, out, 1, fixup=False).fixup  # a reduce-launch kernel, unforced


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["awq", "fp8"])
@pytest.mark.parametrize("m", [1, 3, 8, 33])
def test_fixup_on_gpu_equals_the_reduce_kernel_and_replays_in_a_cuda_graph(fmt, m, monkeypatch):
    """Qwen3-4B's shapes and one with partial column tiles (N = 2600), bf16, with a bias on one of them; then the
    o_proj captured in a CUDA graph after the counters are allocated (as `CudaBackend` does), replayed three times
    on new inputs: each replay equals an eager call of the reduce path, and the counters stay at 0."""
    shapes = QWEN3_4B + ((2600, 2560),)
    for i, (n, k) in enumerate(shapes):
        operands = (awq_operands(n, k, 128, "cuda", seed=n) if fmt == "awq"
                    else fp8_operands([n], k, (128, 128), "cuda", seed=n))
        bias = activations(n, 1, torch.bfloat16, "cuda", 7).reshape(n) if i % 2 else None
        x = activations(m, k, torch.bfloat16, "cuda")

        def run(fixup: bool) -> torch.Tensor:
            monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", fixup)
            if fmt == "awq":
                return A.awq_linear(x, *operands, bias)
            return F8.fp8_block_linear(x, *operands, 128, bias)

        reduced = run(False)
        first, second = run(True), run(True)
        torch.cuda.synchronize()
        assert torch.equal(first, reduced) and torch.equal(second, reduced), (n, k)
        assert _counters_zero("cuda")

    n, k = QWEN3_4B[1]
    operands = awq_operands(n, k, 128, "cuda") if fmt == "awq" else fp8_operands([n], k, (128, 128), "cuda")
    bias = activations(n, 1, torch.bfloat16, "cuda", 7).reshape(n)
    x = activations(m, k, torch.bfloat16, "cuda")

    def gemm() -> torch.Tensor:
        return A.awq_linear(x, *operands, bias) if fmt == "awq" else F8.fp8_block_linear(x, *operands, 128, bias)

    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    split_k.allocate_counters(torch.device("cuda"))
    gemm()  # warm-up outside the capture (Triton compiles here)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemm()
    for seed in (5, 6, 7):
        x.copy_(activations(m, k, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", False)
        expected = gemm()
        monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
        torch.cuda.synchronize()
        assert torch.equal(captured, expected), seed
        assert _counters_zero("cuda")


@pytest.mark.parametrize(("raw", "expected"), [(None, 2048), ("", 2048), ("0", 0), (" 512 ", 512)])
def test_sum_chunk_switch_parses(raw, expected) -> None:  # noqa: ANN001
    environ = {} if raw is None else {split_k.SUM_CHUNK_ENV: raw}
    assert split_k.sum_chunk_elements(environ) == expected


@pytest.mark.parametrize("raw", ["-1", "many", "2k"])
def test_sum_chunk_switch_refuses_other_values(raw) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=split_k.SUM_CHUNK_ENV):
        split_k.sum_chunk_elements({split_k.SUM_CHUNK_ENV: raw})


@pytest.mark.parametrize(("raw", "expected"), [(None, 512), (" ", 512), ("1024", 1024)])
def test_target_programs_switch_parses(raw, expected) -> None:  # noqa: ANN001
    environ = {} if raw is None else {split_k.TARGET_PROGRAMS_ENV: raw}
    assert split_k.target_programs(environ) == expected


@pytest.mark.parametrize("raw", ["0", "-5", "lots"])
def test_target_programs_switch_refuses_other_values(raw) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=split_k.TARGET_PROGRAMS_ENV):
        split_k.target_programs({split_k.TARGET_PROGRAMS_ENV: raw})
