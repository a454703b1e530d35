"""The skinny GEMM (decode-size linear layers) against `x.float() @ w.float().T`."""

from __future__ import annotations

import json

import pytest
import torch

from infer_backend_cuda.kernels import skinny_gemm as S
from tests.backend_cuda.conftest import gpu, needs_cuda, poison, tol

CONFIGS = [S.SkinnyConfig(4, 64, 2, 1), S.SkinnyConfig(2, 128, 4, 2), S.SkinnyConfig(8, 32, 1, 3)]


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 0.25).to(dtype=dtype, device=device)


def _reference(x, w, b=None):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}w{c.num_warps}s{c.num_stages}")
def test_skinny_linear_matches_reference(m, dtype, config, device):
    # N = 37 leaves a partial row block; K = 200 a partial K chunk for every config; 128 is K-even.
    for n, k in ((37, 200), (24, 128)):
        x = _rand((m, k), dtype, device, 1 + m)
        w = _rand((n, k), dtype, device, 2 + n)
        out = poison(torch.empty((m, n), dtype=dtype, device=device))
        y = S.skinny_linear(x, w, out=out, config=config)
        assert y is out
        torch.testing.assert_close(y.float(), _reference(x, w), **tol(dtype))


def test_skinny_linear_bias_strided_input_and_default_config(device):
    wide = _rand((3, 300), torch.float32, device, 5)
    x = wide[:, 44:244]  # rows strided by 300, last dim contiguous (a slice of a wider GEMM output)
    w = _rand((50, 200), torch.float32, device, 6)
    b = _rand((50,), torch.float32, device, 7)
    y = S.skinny_linear(x, w, b)
    torch.testing.assert_close(y, _reference(x, w, b), atol=2e-4, rtol=2e-4)


def test_skinny_linear_rejects_bad_shapes(device):
    w = torch.zeros((8, 16), device=device)
    with pytest.raises(ValueError, match="1..8 rows"):
        S.skinny_linear(torch.zeros((9, 16), device=device), w)
    with pytest.raises(ValueError, match="do not match"):
        S.skinny_linear(torch.zeros((2, 15), device=device), w)
    with pytest.raises(ValueError, match="contiguous"):
        S.skinny_linear(torch.zeros((16, 2), device=device).T, w)


def test_heuristic_config_bounds_the_register_tile():
    for m in range(1, S.MAX_M + 1):
        for n, k in ((6144, 2560), (2560, 9728), (151936, 2560), (24, 40)):
            c = S.heuristic_config(m, n, k)
            assert S.m_bucket(m) * c.block_n * c.block_k <= 8192
            assert c.block_k <= max(16, S.next_pow2(k))
    assert [S.m_bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_tuned_table_entries_are_launchable():
    """The committed table (written on the GPU by scripts/bench_skinny_gemm.py) holds sane configs."""
    if not S._TABLE.exists():
        pytest.skip("no tuned table committed")
    table = json.loads(S._TABLE.read_text())
    assert table, "an empty table file"
    for device_name, entries in table.items():
        assert entries, device_name
        for e in entries:
            assert e["m"] in (1, 2, 4, 8)
            for key in ("block_n", "block_k", "num_warps"):
                assert e[key] & (e[key] - 1) == 0, e
            assert e["m"] * e["block_n"] * e["block_k"] <= 16384, e
            assert e["num_stages"] >= 1


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8])
def test_skinny_linear_qwen3_shapes_on_gpu(m):
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560)):
        x = _rand((m, k), torch.bfloat16, "cuda", m)
        w = _rand((n, k), torch.bfloat16, "cuda", n) * 0.05
        y = S.skinny_linear(x, w)
        ref = _reference(x, w)
        torch.testing.assert_close(y.float(), ref, atol=3e-2 * ref.abs().max().item() ** 0.5, rtol=2e-2)


@gpu
@needs_cuda
def test_cuda_math_ops_routes_decode_rows_to_the_skinny_gemm():
    """Up to 8 bf16 rows go through the skinny kernel (or cuBLAS where the tuned table says so), more rows
    through cuBLAS; every path gives F.linear's answer."""
    import torch.nn.functional as F

    from infer_backend_cuda.ops import CudaMathOps

    ops, plain = CudaMathOps(), CudaMathOps(skinny_gemm=False)
    w = _rand((576, 1536), torch.bfloat16, "cuda", 3) * 0.05
    b = _rand((576,), torch.bfloat16, "cuda", 4)
    for m in (1, 3, 8, 9, 64):
        x = _rand((m, 1536), torch.bfloat16, "cuda", 10 + m)
        ref = F.linear(x.float(), w.float(), b.float())
        for impl in (ops, plain):
            torch.testing.assert_close(impl.linear(x, w, b).float(), ref, atol=5e-2, rtol=2e-2)
