"""The skinny GEMM (decode-size linear layers) against `x.float() @ w.float().T`."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.kernels import skinny_gemm as S
from tests.backend_cuda.conftest import LaunchSpy, committed_table_entries, gpu, needs_cuda, poison, tol
from tests.backend_cuda.reference import rand_offset, ref_add_rms_norm, ref_linear, ref_rms_norm, ref_silu_and_mul
from tests.bench.scripts import KERNEL_SCRIPTS, load_bench_script

CONFIGS = [S.SkinnyConfig(4, 64, 2, 1), S.SkinnyConfig(2, 128, 4, 2), S.SkinnyConfig(8, 32, 1, 3),
           S.SkinnyConfig(16, 64, 4, 2, use_dot=True), S.SkinnyConfig(32, 32, 4, 1, use_dot=True),
           S.SkinnyConfig(4, 64, 2, 1, prefetch=True), S.SkinnyConfig(16, 64, 4, 2, use_dot=True, prefetch=True)]


def _fused_tol(dtype, ref):
    """The fused kernels keep the normed / activated row in fp32 where the unfused ops round it to the
    activation dtype: at bf16 that is ~1 % of the output's scale (and the interpreter truncates)."""
    return tol(dtype) if dtype == torch.float32 else dict(atol=1.5e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: f"n{c.block_n}k{c.block_k}w{c.num_warps}s{c.num_stages}{'dot' * c.use_dot}{'pf' * c.prefetch}",
)
def test_skinny_linear_matches_reference(m, dtype, config, device):
    # N = 37 leaves a partial row block; K = 200 a partial K chunk for every config; 128 is K-even.
    for n, k in ((37, 200), (24, 128)):
        x = rand_offset((m, k), dtype, device, 1 + m)
        w = rand_offset((n, k), dtype, device, 2 + n)
        out = poison(torch.empty((m, n), dtype=dtype, device=device))
        y = S.skinny_linear(x, w, out=out, config=config)
        assert y is out
        torch.testing.assert_close(y.float(), ref_linear(x, w), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("use_dot", [False, True])
def test_skinny_add_rms_norm_linear_matches_unfused(m, dtype, with_residual, use_dot, device):
    prefetch = m == 3  # one row count also runs the weight-prefetching loop
    k, n = 200, 37  # several programs (one of which writes the residual stream), a partial K chunk
    x = rand_offset((m, k), dtype, device, 20 + m) * 2
    residual = rand_offset((m, k), dtype, device, 21 + m) if with_residual else None
    norm_w = rand_offset((k,), dtype, device, 22)
    w = rand_offset((n, k), dtype, device, 23)
    b = rand_offset((n,), dtype, device, 24)
    x0 = x.clone()
    out = poison(torch.empty((m, n), dtype=dtype, device=device))
    res_out = poison(torch.empty((m, k), dtype=dtype, device=device)) if with_residual else None
    y, stream = S.skinny_add_rms_norm_linear(x, residual, norm_w, 1e-5, w, b, out=out, residual_out=res_out,
                                             config=S.SkinnyConfig(16 if use_dot else 4, 64, 2, 1, use_dot, prefetch))
    if with_residual:
        normed, ref_stream = ref_add_rms_norm(x, residual, norm_w, 1e-5)
        assert stream is res_out
        torch.testing.assert_close(stream.float(), ref_stream.float(), **tol(dtype))
    else:
        normed, ref_stream = ref_rms_norm(x, norm_w, 1e-5), x
        assert stream is x
    assert y is out
    ref = ref_linear(normed, w, b)
    torch.testing.assert_close(y.float(), ref, **_fused_tol(dtype, ref))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("op", ["linear", "gated", "norm", "add_norm"])
@pytest.mark.parametrize("n", [24, 38], ids=["whole_tiles", "partial_tiles"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_row_wise_and_3d_products_give_the_reference(m, op, n, prefetch, device, monkeypatch):
    """At 1-2 rows a `rowwise` config accumulates a 2D product a row (ROWWISE) unless INFER_CUDA_SKINNY_ROWWISE=0
    keeps the 3D one, as the same tile without `rowwise` does: each form equals the reference for each op, with and
    without partial tiles (the weight loads' masks, EVEN_N and EVEN_K). The launches are spied so that each form is
    known to have run."""
    # whole tiles every way (EVEN_K and EVEN_N: the prefetch unmasked, re-reading its last tile), or partial ones
    dtype, k = torch.float32, 512 if n == 24 else 600
    config = S.SkinnyConfig(4, 256, 2, 1, prefetch=prefetch)  # 256 fp32 columns: 16-byte loads by 64 threads along K
    assert S.rowwise_fits(config, 4) and not S.rowwise_fits(config._replace(num_warps=4), 4)
    x = rand_offset((m, k), dtype, device, 60 + m) * 2
    r = rand_offset((m, k), dtype, device, 61)
    nw = rand_offset((k,), dtype, device, 62)
    w = rand_offset((n, k), dtype, device, 63)
    b = rand_offset((n,), dtype, device, 64)
    if op == "linear":
        ref, run = ref_linear(x, w, b), lambda: S.skinny_linear(x, w, b, config=config)
    elif op == "gated":
        ref = ref_silu_and_mul(ref_linear(x, w, b))
        run = lambda: S.skinny_linear_silu_mul(x, w, b, config=config)  # noqa: E731
    else:
        residual = r if op == "add_norm" else None
        normed = ref_add_rms_norm(x, r, nw, 1e-5)[0] if residual is not None else ref_rms_norm(x, nw, 1e-5)
        ref = ref_linear(normed, w, b)
        run = lambda: S.skinny_add_rms_norm_linear(x, residual, nw, 1e-5, w, b, config=config)[0]  # noqa: E731
    spy = LaunchSpy(S._skinny_gemm_kernel)
    monkeypatch.setattr(S, "_skinny_gemm_kernel", spy)
    for switch, rowwise in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(S, "ROWWISE", switch)
        config = config._replace(rowwise=rowwise)
        torch.testing.assert_close(run().float(), ref, **tol(dtype))
    assert [launch["ROWWISE"] for launch in spy.launches] == [False, False, True]
    even = (n // 2 if op == "gated" else n) % (config.block_n // 2 if op == "gated" else config.block_n) == 0
    assert {(launch["EVEN_N"], launch["EVEN_K"]) for launch in spy.launches} == {(even, n == 24)}


@pytest.mark.parametrize("config,m", [(S.SkinnyConfig(4, 64, 2, 1), 3), (S.SkinnyConfig(4, 256, 2, 1, rowwise=True), 2),
                                      (S.SkinnyConfig(16, 64, 4, 2, use_dot=True), 5)],
                         ids=["cores", "rowwise", "dot"])
@pytest.mark.parametrize("op", ["linear", "gated", "add_norm"])
def test_the_preloaded_first_step_gives_the_plain_loops_output_bit_for_bit(config, m, op, device, monkeypatch):
    """INFER_CUDA_SKINNY_PRELOAD=1 peels the first K step off the loop (its weight tile asked for before the wait):
    the same products in the same order, so the output and the new residual stream equal the plain loop's bit for
    bit, on whole and partial tiles (N = 24 / 38; K = 512, 600 or 64: several steps, a partial last one, or a single
    step with an empty loop). A `prefetch` config keeps its own loop. The launches are spied so that each form is
    known to have run."""
    spy = LaunchSpy(S._skinny_gemm_kernel)
    monkeypatch.setattr(S, "_skinny_gemm_kernel", spy)
    for n, k in ((24, 512), (38, 600), (38, 64)):
        x = rand_offset((m, k), torch.float32, device, 70 + m) * 2
        r = rand_offset((m, k), torch.float32, device, 71)
        nw = rand_offset((k,), torch.float32, device, 72)
        w = rand_offset((n, k), torch.float32, device, 73)
        b = rand_offset((n,), torch.float32, device, 74)
        runs = []
        for preload in (False, True):
            monkeypatch.setattr(S, "PRELOAD", preload)
            if op == "linear":
                runs.append((S.skinny_linear(x, w, b, config=config),))
            elif op == "gated":
                runs.append((S.skinny_linear_silu_mul(x, w, b, config=config),))
            else:
                runs.append(S.skinny_add_rms_norm_linear(x, r, nw, 1e-5, w, b, residual_out=torch.empty_like(x),
                                                         config=config))
        assert all(torch.equal(plain, peeled) for plain, peeled in zip(*runs)), (n, k)
        if op == "linear":
            torch.testing.assert_close(runs[1][0], ref_linear(x, w, b), **tol(torch.float32))
    monkeypatch.setattr(S, "PRELOAD", True)
    S.skinny_linear(x, w, b, config=config._replace(prefetch=True))
    assert [launch["PRELOAD"] for launch in spy.launches] == [False, True] * 3 + [False]


def test_the_preload_switch_is_off_unless_set_and_refuses_other_values():
    assert not S.preload_switch({}) and not S.preload_switch({S.PRELOAD_ENV: "0"})
    assert S.preload_switch({S.PRELOAD_ENV: "1"})
    with pytest.raises(ValueError, match="INFER_CUDA_SKINNY_PRELOAD='yes'"):
        S.preload_switch({S.PRELOAD_ENV: "yes"})


def test_the_kernel_tuner_times_gate_up_as_the_model_runs_it(device, monkeypatch):
    """bench_skinny_gemm.py times the gate / up shape's `linear` entry through the SiLU-and-mul epilogue that takes it
    in the model (against cuBLAS then the SiLU kernel), only while INFER_CUDA_GATED_GEMM is on."""
    bench = load_bench_script("bench_skinny_gemm", KERNEL_SCRIPTS)
    assert bench.gated_case("linear", "gate_up") and not bench.gated_case("linear", "o_proj")
    assert not bench.gated_case("add_rms_norm_linear", "gate_up")
    torch.manual_seed(0)
    case = bench.Case("linear", 2, 48, 256, 2, device, gated=True)
    for config in (S.SkinnyConfig(4, 128, 2, 1), S.SkinnyConfig(4, 256, 1, 1, rowwise=True)):
        y, ref = case.skinny(1, config), case.baseline(1)
        assert y.shape == ref.shape == (2, 24)
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    monkeypatch.setattr(S, "GATED", False)
    assert not bench.gated_case("linear", "gate_up")


def test_skinny_add_rms_norm_linear_refuses_an_aliased_residual_out(device):
    x, r = rand_offset((2, 64), torch.float32, device, 1), rand_offset((2, 64), torch.float32, device, 2)
    w, nw = rand_offset((8, 64), torch.float32, device, 3), rand_offset((64,), torch.float32, device, 4)
    with pytest.raises(ValueError, match="alias"):
        S.skinny_add_rms_norm_linear(x, r, nw, 1e-6, w, residual_out=r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "config", [CONFIGS[0], CONFIGS[3], CONFIGS[6], None], ids=["cores", "dot", "dot-prefetch", "default"]
)
def test_skinny_linear_silu_mul_equals_the_gemm_then_silu(m, dtype, config, device):
    """The gate / up GEMM with SiLU-and-mul in its epilogue: each program's rows come from both halves (the
    intermediate size 37 leaves a part-full last program), equal to the plain kernel's output through
    `silu_and_mul` (both round the GEMM output first)."""
    inter, k = 37, 96
    x = rand_offset((m, k), dtype, device, 40 + m)
    w = rand_offset((2 * inter, k), dtype, device, 41) * 0.5
    b = rand_offset((2 * inter,), dtype, device, 42)
    out = poison(torch.empty((m, inter), dtype=dtype, device=device))
    y = S.skinny_linear_silu_mul(x, w, b, out=out, config=config)
    assert y is out
    expected = ref_silu_and_mul(S.skinny_linear(x, w, b, config=config))
    torch.testing.assert_close(y.float(), expected.float(), **tol(dtype))
    ref = ref_silu_and_mul(ref_linear(x, w, b).to(dtype))
    torch.testing.assert_close(y.float(), ref.float(), **_fused_tol(dtype, ref.float()))
    with pytest.raises(ValueError, match="even"):
        S.skinny_linear_silu_mul(x, w[1:])


def test_skinny_linear_bias_strided_input_and_default_config(device):
    wide = rand_offset((3, 300), torch.float32, device, 5)
    x = wide[:, 44:244]  # rows strided by 300, last dim contiguous (a slice of a wider GEMM output)
    w = rand_offset((50, 200), torch.float32, device, 6)
    b = rand_offset((50,), torch.float32, device, 7)
    y = S.skinny_linear(x, w, b)
    torch.testing.assert_close(y, ref_linear(x, w, b), atol=2e-4, rtol=2e-4)


def test_skinny_linear_rejects_bad_shapes(device):
    w = torch.zeros((8, 16), device=device)
    with pytest.raises(ValueError, match="1..8 rows"):
        S.skinny_linear(torch.zeros((0, 16), device=device), w)
    with pytest.raises(ValueError, match="1..8 rows"):
        S.skinny_linear(torch.zeros((9, 16), device=device), w)
    with pytest.raises(ValueError, match="do not match"):
        S.skinny_linear(torch.zeros((2, 15), device=device), w)
    with pytest.raises(ValueError, match="contiguous"):
        S.skinny_linear(torch.zeros((16, 2), device=device).T, w)


def test_untuned_shapes_above_two_rows_stay_on_cublas():
    cpu = torch.device("cpu")
    assert S.choose_config("linear", 1, 24, 40, cpu) == S.heuristic_config(1, 24, 40)
    assert S.choose_config("add_rms_norm_linear", 2, 24, 40, cpu) is not None
    assert S.choose_config("linear", 3, 24, 40, cpu) is None
    with pytest.raises(ValueError, match="unknown"):
        S.choose_config("matmul", 1, 24, 40, cpu)


def test_heuristic_config_bounds_the_register_tile():
    for m in range(1, S.MAX_M + 1):
        for n, k in ((6144, 2560), (2560, 9728), (151936, 2560), (24, 40)):
            c = S.heuristic_config(m, n, k)
            assert S.m_bucket(m) * c.block_n * c.block_k <= 8192
            assert c.block_k <= max(16, S.next_pow2(k))
    assert [S.m_bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_tuned_table_entries_are_launchable():
    """The committed table (written on the GPU by packages/infer-backend-cuda/scripts/bench_skinny_gemm.py) holds
    sane configs."""
    for e in committed_table_entries(S._TABLE):
        assert e["m"] in (1, 2, 4, 8) and e.get("op", "linear") in S.OPS
        for key in ("block_n", "block_k", "num_warps"):
            assert e[key] & (e[key] - 1) == 0, e
        rows = S.block_m(e["m"], e.get("use_dot", False))
        assert rows * e["block_n"] * e["block_k"] <= 16384 or e.get("use_dot"), e
        assert not e.get("use_dot") or e["block_n"] >= 16, e
        if e.get("rowwise"):  # tuned where the row-wise form fits the bf16 tile, at 1-2 rows
            tile = S.SkinnyConfig(e["block_n"], e["block_k"], e["num_warps"], e["num_stages"], e.get("use_dot", False))
            assert e["m"] <= 2 and S.rowwise_fits(tile, 2), e
        assert e["num_stages"] >= 1


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8])
def test_skinny_linear_qwen3_shapes_on_gpu(m):
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560)):
        x = rand_offset((m, k), torch.bfloat16, "cuda", m)
        w = rand_offset((n, k), torch.bfloat16, "cuda", n) * 0.05
        y = S.skinny_linear(x, w)
        ref = ref_linear(x, w)
        torch.testing.assert_close(y.float(), ref, atol=3e-2 * ref.abs().max().item() ** 0.5, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_skinny_linear_silu_mul_gate_up_shapes_on_gpu(m):
    """The gated epilogue with each model's tuned gate / up config (Qwen3-4B, Qwen3.5-4B) against the plain GEMM
    then `silu_and_mul`."""
    for n, k in ((19456, 2560), (18432, 2560)):
        x = rand_offset((m, k), torch.bfloat16, "cuda", m)
        w = rand_offset((n, k), torch.bfloat16, "cuda", n) * 0.05
        config = S.choose_config("linear", m, n, k, torch.device("cuda")) or S.heuristic_config(m, n, k)
        y = S.skinny_linear_silu_mul(x, w, config=config)
        expected = ref_silu_and_mul(S.skinny_linear(x, w, config=config))
        torch.testing.assert_close(y, expected, atol=0, rtol=0)


@gpu
@needs_cuda
def test_cuda_math_ops_routes_decode_rows_to_the_skinny_gemm():
    """Up to 8 bf16 rows go through the skinny kernel (or cuBLAS where the tuned table says so), more rows
    through cuBLAS; every path gives F.linear's answer."""
    import torch.nn.functional as F

    from infer_backend_cuda.ops import CudaMathOps

    ops, plain = CudaMathOps(), CudaMathOps(skinny_gemm=False)
    # Qwen3-4B's down projection at one row is in the H200 table as a skinny win.
    assert ops.triton_gemm_config("linear", torch.empty((1, 9728), device="cuda", dtype=torch.bfloat16),
                             torch.empty((2560, 9728), device="cuda", dtype=torch.bfloat16)) is not None
    w = rand_offset((576, 1536), torch.bfloat16, "cuda", 3) * 0.05
    b = rand_offset((576,), torch.bfloat16, "cuda", 4)
    for m in (1, 3, 8, 9, 64):
        x = rand_offset((m, 1536), torch.bfloat16, "cuda", 10 + m)
        ref = F.linear(x.float(), w.float(), b.float())
        for impl in (ops, plain):
            torch.testing.assert_close(impl.linear(x, w, b).float(), ref, atol=5e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 8, 64])
def test_fused_port_ops_on_gpu_match_the_unfused_ops(m):
    """TritonFusedOps.add_rms_norm_linear and the dense LinearOps.add_rms_norm_linear_silu_mul at Qwen3-4B shapes:
    skinny at decode sizes, norm kernel + GEMM above, both equal to the unfused composition."""
    from infer_backend_cuda.linear_ops import CudaLinears
    from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
    from infer_core.quant import DENSE

    math = CudaMathOps()
    ops = TritonFusedOps(math)
    h, inter = 2560, 9728
    x = rand_offset((m, h), torch.bfloat16, "cuda", 1)
    r = rand_offset((m, h), torch.bfloat16, "cuda", 2)
    nw = rand_offset((h,), torch.bfloat16, "cuda", 3) * 0.1 + 1
    w_qkv = rand_offset((6144, h), torch.bfloat16, "cuda", 4) * 0.02
    y, stream = ops.add_rms_norm_linear(x, r, nw, 1e-6, w_qkv, None)
    normed, ref_stream = ref_add_rms_norm(x, r, nw, 1e-6)
    torch.testing.assert_close(stream, ref_stream)
    torch.testing.assert_close(y.float(), ref_linear(normed, w_qkv), atol=5e-2, rtol=3e-2)
    y0, stream0 = ops.add_rms_norm_linear(x, None, nw, 1e-6, w_qkv, None)
    assert stream0 is x
    torch.testing.assert_close(y0.float(), ref_linear(ref_rms_norm(x, nw, 1e-6), w_qkv), atol=5e-2, rtol=3e-2)
    w_gate_up = rand_offset((2 * inter, h), torch.bfloat16, "cuda", 6) * 0.02
    act, _ = CudaLinears(math, ops).bind(DENSE).add_rms_norm_linear_silu_mul(x, r, nw, 1e-6, (w_gate_up,), None)
    ref = ref_silu_and_mul(ref_linear(normed, w_gate_up).to(torch.bfloat16)).float()
    torch.testing.assert_close(act.float(), ref, atol=5e-2, rtol=3e-2)


def test_programmatic_dependent_launch_only_on_a_hopper_gpu():
    from infer_backend_cuda.kernels._common import pdl_launch

    assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability(0)[0] >= 9
        assert pdl_launch(torch.device("cuda", 0))["USE_PDL"] is hopper


def test_adapter_switches_are_not_taken_for_config_fields(monkeypatch):
    """The CUDA adapter's A/B switches live outside the RUSTINFER_ prefix, which the config loader reserves
    (and refuses unknown names under)."""
    from infer_backend_cuda.backend import SKINNY_GEMM_ENV
    from infer_backend_cuda.kernels._common import PDL_ENV
    from infer_protocol.config import load_config

    monkeypatch.setenv(SKINNY_GEMM_ENV, "0")
    monkeypatch.setenv(PDL_ENV, "0")
    assert load_config(None).backend  # loads: the switches are not taken for (unknown) config fields


@pytest.mark.parametrize("gated", [True, False])
def test_dense_linear_ops_apply_the_silu_in_the_gate_up_epilogue(gated, device, monkeypatch):
    """`LinearOps.add_rms_norm_linear_silu_mul` on dense bf16 decode rows: the norm kernel, then the gated skinny GEMM
    (with `INFER_CUDA_GATED_GEMM=0` the plain GEMM and the SiLU-and-mul kernel), equal to the unfused reference."""
    from infer_backend_cuda.linear_ops import CudaLinears
    from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
    from infer_core.quant import DENSE

    monkeypatch.setattr(S, "GATED", gated)
    launches = []
    real = S.skinny_linear_silu_mul
    monkeypatch.setattr(S, "skinny_linear_silu_mul", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    math = CudaMathOps()
    ops = CudaLinears(math, TritonFusedOps(math)).bind(DENSE)
    x, residual = (rand_offset((2, 64), torch.bfloat16, device, s) for s in (50, 51))
    norm_w = rand_offset((64,), torch.bfloat16, device, 52)
    w = rand_offset((48, 64), torch.bfloat16, device, 53) * 0.3
    act, h = ops.add_rms_norm_linear_silu_mul(x, residual, norm_w, 1e-6, (w,), None)
    normed, stream = ref_add_rms_norm(x, residual, norm_w, 1e-6)
    ref = ref_silu_and_mul(ref_linear(normed, w).to(torch.bfloat16)).float()
    torch.testing.assert_close(h.float(), stream.float(), **tol(torch.bfloat16))  # the interpreter truncates
    torch.testing.assert_close(act.float(), ref, **_fused_tol(torch.bfloat16, ref))
    assert len(launches) == (1 if gated else 0)


@pytest.mark.parametrize(("raw", "expected"), [("", {}), ("2:4", {2: 4}), (" 1:2, 2:4 ", {1: 2, 2: 4})])
def test_row_bucket_remap_parses(raw, expected) -> None:  # noqa: ANN001
    assert S.parse_row_buckets(raw) == expected


@pytest.mark.parametrize("raw", ["2", "2:3", "a:b", "16:4"])
def test_row_bucket_remap_refuses_bad_values(raw) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=S.ROW_BUCKETS_ENV):
        S.parse_row_buckets(raw)


def test_rows_of_a_remapped_bucket_take_the_other_buckets_entry(monkeypatch) -> None:  # noqa: ANN001
    two, four = S.SkinnyConfig(64, 128, 4, 2), S.SkinnyConfig(32, 256, 4, 3, use_dot=True)
    table = {("linear", 2, 6144, 2560): two, ("linear", 4, 6144, 2560): four, ("linear", 4, 2560, 4096): None}
    monkeypatch.setattr(S, "_tuned_table", lambda name: table)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    cuda = torch.device("cuda", 0)
    assert S.choose_config("linear", 2, 6144, 2560, cuda) == two
    monkeypatch.setattr(S, "ROW_BUCKETS", {2: 4})
    assert S.choose_config("linear", 2, 6144, 2560, cuda) == four
    assert S.choose_config("linear", 2, 2560, 4096, cuda) is None  # cuBLAS, as the 4-row bucket says
    assert S.choose_config("linear", 1, 6144, 2560, cuda) == S.heuristic_config(1, 6144, 2560)  # other rows as before
