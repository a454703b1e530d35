"""The mid GEMM (2-128 decode rows) against `x.float() @ w.float().T`, its split-K sums and its routing."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.kernels import mid_gemm as G
from infer_backend_cuda.kernels import split_k
from tests.backend_cuda.conftest import committed_table_entries, gpu, needs_cuda, poison, tol
from tests.backend_cuda.reference import rand_offset, ref_linear, ref_silu_and_mul

# Interpreter-sized tiles; the GPU tiles of the table are 64-128 columns, 64-128 K.
CONFIGS = [G.MidConfig(16, 32, 4, 2), G.MidConfig(32, 64, 4, 3, 3), G.MidConfig(16, 16, 4, 1, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 9, 16, 33])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.k_splits}")
def test_mid_linear_matches_reference(m, dtype, config, device):
    # N = 37 leaves a partial column tile; K = 200 a partial K step for every config (and ranges of unequal
    # length where K is split); K = 96 divides every tile's K step.
    for n, k, with_bias in ((37, 200, True), (48, 96, False)):
        x = rand_offset((m, k), dtype, device, 1 + m)
        w = rand_offset((n, k), dtype, device, 2 + n)
        b = rand_offset((n,), dtype, device, 3) if with_bias else None
        out = poison(torch.empty((m, n), dtype=dtype, device=device))
        y = G.mid_linear(x, w, b, out=out, config=config)
        assert y is out
        torch.testing.assert_close(y.float(), ref_linear(x, w, b), **tol(dtype))


def test_split_ranges_sum_in_a_fixed_order_with_and_without_the_fixup(device, monkeypatch):
    """Split K: the last program of a tile sums the partials (no second launch), the reduce kernel's sum bit for
    bit; no counters left set."""
    m, n, k = 20, 40, 256
    x = rand_offset((m, k), torch.float32, device, 7)
    w = rand_offset((n, k), torch.float32, device, 8)
    b = rand_offset((n,), torch.float32, device, 9)
    config = G.MidConfig(16, 32, 4, 1, 4)
    split_k.allocate_counters(torch.device(device))
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    fixed = G.mid_linear(x, w, b, config=config)
    assert int(split_k.counters(torch.device(device)).abs().sum()) == 0
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", False)
    reduced = G.mid_linear(x, w, b, config=config)
    assert torch.equal(fixed, reduced)
    torch.testing.assert_close(fixed, ref_linear(x, w, b), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [9, 24])
def test_mid_linear_silu_mul_equals_the_gemm_then_silu(m, dtype, device):
    """Gate / up rows paired in each program (intermediate 37: a part-full last tile), equal to the plain kernel's
    output through `silu_and_mul` (both round the GEMM output first)."""
    inter, k = 37, 96
    config = G.MidConfig(16, 32, 4, 2)
    x = rand_offset((m, k), dtype, device, 40 + m)
    w = rand_offset((2 * inter, k), dtype, device, 41) * 0.5
    b = rand_offset((2 * inter,), dtype, device, 42)
    out = poison(torch.empty((m, inter), dtype=dtype, device=device))
    y = G.mid_linear_silu_mul(x, w, b, out=out, config=config)
    assert y is out
    expected = ref_silu_and_mul(G.mid_linear(x, w, b, config=config))
    torch.testing.assert_close(y.float(), expected.float(), **tol(dtype))
    with pytest.raises(ValueError, match="even"):
        G.mid_linear_silu_mul(x, w[1:], config=config)
    with pytest.raises(ValueError, match="one K range"):
        G.mid_linear_silu_mul(x, w, config=config._replace(k_splits=2))


def test_mid_linear_rejects_bad_shapes(device):
    w = torch.zeros((8, 16), device=device)
    config = CONFIGS[0]
    with pytest.raises(ValueError, match="1..128 rows"):
        G.mid_linear(torch.zeros((129, 16), device=device), w, config=config)
    with pytest.raises(ValueError, match="do not match"):
        G.mid_linear(torch.zeros((12, 15), device=device), w, config=config)
    with pytest.raises(ValueError, match="contiguous"):
        G.mid_linear(torch.zeros((16, 12), device=device).T, w, config=config)


def test_untuned_shapes_and_cpu_tensors_stay_on_cublas():
    cpu = torch.device("cpu")
    assert G.choose_config("linear", 64, 6144, 2560, cpu) is None
    with pytest.raises(ValueError, match="unknown"):
        G.choose_config("add_rms_norm_linear", 64, 6144, 2560, cpu)
    assert [G.m_bucket(m) for m in (2, 3, 8, 9, 16, 17, 33, 65, 128)] == [2, 4, 8, 16, 16, 32, 64, 128, 128]
    assert [G.block_m(m) for m in (2, 8, 9, 17, 128)] == [16, 16, 16, 32, 128]
    assert G.choose_config("linear", 1, 2560, 4096, cpu) is None  # one row is the skinny GEMM's
    assert G.m_bucket(1) == 1  # but FP8's from one row (a GPU's table entry)


def test_math_ops_route_mid_rows_by_the_table(monkeypatch):
    """9-128 bf16 rows take the mid GEMM where this GPU's table has a winning entry for the op, else cuBLAS; at 2-8
    rows the skinny GEMM's config comes first and the mid table serves what it leaves to cuBLAS; fp32 and the
    norm-prologue op never take the mid kernel."""
    from infer_backend_cuda.kernels import skinny_gemm as S
    from infer_backend_cuda.ops import CudaMathOps

    winner = G.MidConfig(128, 64, 8, 4, 2)
    table = {("linear", 64, 48, 32): winner, ("linear_silu_mul", 64, 48, 32): winner._replace(k_splits=1),
             ("linear", 128, 48, 32): None, ("linear", 4, 48, 32): winner, ("linear", 2, 48, 32): winner}
    monkeypatch.setattr(G, "choose_config", lambda op, m, n, k, device: table.get((op, G.m_bucket(m), n, k)))
    skinny_winner = S.SkinnyConfig(64, 128, 4, 3, use_dot=True)
    skinny_table = {("linear", 2, 48, 32): skinny_winner}
    monkeypatch.setattr(S, "choose_config", lambda op, m, n, k, device: skinny_table.get((op, S.m_bucket(m), n, k)))
    ops = CudaMathOps()
    w = torch.empty((48, 32), dtype=torch.bfloat16)
    rows = lambda m, dtype=torch.bfloat16: torch.empty((m, 32), dtype=dtype)  # noqa: E731
    assert ops.triton_gemm_config("linear", rows(40), w) == winner
    assert ops.triton_gemm_config("linear_silu_mul", rows(64), w) == winner._replace(k_splits=1)
    assert ops.triton_gemm_config("linear", rows(100), w) is None  # cuBLAS measured faster
    assert ops.triton_gemm_config("linear", rows(20), w) is None  # untuned bucket
    assert ops.triton_gemm_config("linear", rows(129), w) is None
    assert ops.triton_gemm_config("linear", rows(3), w) == winner  # the skinny table left 3-4 rows to cuBLAS
    assert ops.triton_gemm_config("linear", rows(2), w) == skinny_winner  # the skinny GEMM first
    assert ops.triton_gemm_config("linear", rows(8), w) is None  # neither table has it
    assert ops.triton_gemm_config("linear", rows(40, torch.float32), w.float()) is None
    assert ops.triton_gemm_config("add_rms_norm_linear", rows(40), w) is None
    assert CudaMathOps(skinny_gemm=False).triton_gemm_config("linear", rows(40), w) is None


def test_adapter_linear_takes_the_mid_kernel_where_routed(monkeypatch, device):
    """`CudaMathOps.linear` and the dense gate / up op with a routed mid config give the reference's answer (on
    the CPU under the interpreter: the same launcher the GPU runs)."""
    from infer_backend_cuda.linear_ops import DenseLinearOps
    from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
    from infer_core.quant import DENSE

    config = G.MidConfig(16, 32, 4, 2)
    ops = CudaMathOps()
    monkeypatch.setattr(ops, "triton_gemm_config", lambda op, x, w: config)
    x = rand_offset((12, 64), torch.bfloat16, device, 1)
    w = rand_offset((2 * 24, 64), torch.bfloat16, device, 2) * 0.1
    torch.testing.assert_close(ops.linear(x, w).float(), ref_linear(x, w), **tol(torch.bfloat16))
    gated = DenseLinearOps(ops, TritonFusedOps(ops), DENSE)._gated_linear(x, w, None)
    expected = ref_silu_and_mul(ref_linear(x, w).to(torch.bfloat16))
    torch.testing.assert_close(gated.float(), expected.float(), **tol(torch.bfloat16))


def test_the_all_switch_takes_the_tuned_config_where_cublas_won(monkeypatch):
    """INFER_CUDA_MID_GEMM_ALL=1 (A/B runs): an entry cuBLAS won keeps its measured config instead of None."""
    entries = [
        {"op": "linear", "m": 128, "n": 2560, "k": 4096, "use": False, "block_n": 64, "block_k": 64,
         "num_warps": 4, "num_stages": 6, "k_splits": 3},
        {"op": "linear", "m": 64, "n": 2560, "k": 4096, "use": True, "block_n": 64, "block_k": 128,
         "num_warps": 4, "num_stages": 4, "k_splits": 1},
    ]
    monkeypatch.setattr(G.tuned_table, "entries", lambda path, device: entries)
    for all_shapes, lost in ((False, None), (True, G.MidConfig(64, 64, 4, 6, 3))):
        monkeypatch.setattr(G, "ALL", all_shapes)
        G._tuned_table.cache_clear()
        try:
            table = G._tuned_table("gpu")
        finally:
            G._tuned_table.cache_clear()
        assert table[("linear", 128, 2560, 4096)] == lost
        assert table[("linear", 64, 2560, 4096)] == G.MidConfig(64, 128, 4, 4, 1)


def test_tuned_table_entries_are_launchable():
    """The committed table (written on the GPU by packages/infer-backend-cuda/scripts/bench_mid_gemm.py) holds
    sane configs."""
    for e in committed_table_entries(G._TABLE):
        assert e["m"] in (2, 4, 8, 16, 32, 64, 128) and e["op"] in G.OPS or (
            e["m"] in (1, 2, 4, 8, 16, 32, 64, 128) and e["op"] in G.FP8_OPS and e["block_k"] == 128), e
        for key in ("block_n", "block_k", "num_warps"):
            assert e[key] & (e[key] - 1) == 0, e
        assert e["block_n"] >= 16 and e["block_k"] >= 16 and e["num_stages"] >= 1 and e["k_splits"] >= 1, e
        assert e["op"] != "linear_silu_mul" or e["k_splits"] == 1, e


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [2, 5, 9, 16, 40, 64, 96, 128])
def test_mid_linear_qwen3_shapes_on_gpu(m):
    """Every tile form the tuner tries, at Qwen3-4B's decode shapes, against the fp32 product."""
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        x = rand_offset((m, k), torch.bfloat16, "cuda", m)
        w = rand_offset((n, k), torch.bfloat16, "cuda", n) * 0.05
        ref = ref_linear(x, w)
        for config in (G.MidConfig(64, 64, 4, 4), G.MidConfig(128, 64, 8, 3, 4), G.MidConfig(64, 128, 4, 3, 2)):
            y = G.mid_linear(x, w, config=config)
            torch.testing.assert_close(y.float(), ref, atol=3e-2 * ref.abs().max().item() ** 0.5, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 64, 128])
def test_mid_linear_silu_mul_gate_up_on_gpu(m):
    x = rand_offset((m, 2560), torch.bfloat16, "cuda", m)
    w = rand_offset((19456, 2560), torch.bfloat16, "cuda", 5) * 0.05
    config = G.MidConfig(128, 64, 8, 3)
    expected = ref_silu_and_mul(G.mid_linear(x, w, config=config))
    torch.testing.assert_close(G.mid_linear_silu_mul(x, w, config=config), expected, atol=0, rtol=0)


@gpu
@needs_cuda
def test_mid_linear_is_graph_capturable_with_split_k():
    """Split-K fix-up inside a CUDA graph: replays give the eager answer (the counters reset every launch)."""
    x = rand_offset((48, 2560), torch.bfloat16, "cuda", 1)
    w = rand_offset((2560, 2560), torch.bfloat16, "cuda", 2) * 0.05
    config = G.MidConfig(64, 64, 4, 4, 4)
    split_k.allocate_counters(torch.device("cuda"))
    eager = G.mid_linear(x, w, config=config)
    out = torch.empty_like(eager)
    G.mid_linear(x, w, out=out, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.mid_linear(x, w, out=out, config=config)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
