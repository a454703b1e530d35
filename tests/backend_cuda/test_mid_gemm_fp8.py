"""The mid GEMM on block-FP8 weights (BLOCK_SCALED): against the W8A8 reference, its gated epilogue, its routing
from `fp8_gemm` and the FP8 linear ops."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cpu.quant_math import fp8_block_linear as ref_fp8_linear
from infer_backend_cuda.kernels import fp8_gemm as F8
from infer_backend_cuda.kernels import mid_gemm as G
from infer_backend_cuda.kernels import split_k
from tests.backend_cuda.conftest import gpu, needs_cuda, poison, tol
from tests.backend_cuda.reference import ref_silu_and_mul
from tests.backend_cuda.quant_operands import activations, fp8_operands

# Interpreter-sized column tiles; the K step is the scale group (64 here, 128 in the published checkpoints).
CONFIGS = [G.MidConfig(16, 64, 4, 2), G.MidConfig(32, 64, 4, 3, 2), G.MidConfig(16, 64, 4, 1, 3)]


def _reference(x, codes, scale_inv, scale_row, group, bias=None):
    return ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), group,
                          bias.cpu() if bias is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}s{c.k_splits}")
def test_fp8_mid_linear_matches_the_w8a8_reference(m, dtype, config, device):
    """Parts 40 and 24 in blocks of 16 rows (a partial scale block, N = 64 a partial column tile for 32-column
    tiles), K = 200 ending in a partial group (and K ranges of unequal length where split), rows far apart in
    magnitude, a zero row (scale 1), a bias added once."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64).to(dtype)
    x = activations(m, 200, torch.float32, device) * torch.logspace(-2, 2, m).reshape(m, 1).to(device)
    x[m // 2] = 0
    x = x.to(dtype)
    out = poison(torch.empty((m, 64), dtype=dtype, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, bias, out=out, config=config)
    assert y is out
    torch.testing.assert_close(y.cpu().float(), _reference(x, codes, scale_inv, scale_row, 64, bias).float(),
                               **tol(dtype))


def test_fp8_mid_split_ranges_sum_in_a_fixed_order_with_and_without_the_fixup(device, monkeypatch):
    """The block-scaled partials through split-K: the last-arrival sum equals the reduce kernel's bit for bit."""
    codes, scale_inv, scale_row = fp8_operands([64], 512, (32, 64), device)
    x = activations(24, 512, torch.float32, device)
    config = G.MidConfig(16, 64, 4, 1, 4)
    split_k.allocate_counters(torch.device(device))
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", True)
    fixed = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, config=config)
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", False)
    reduced = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, config=config)
    assert torch.equal(fixed, reduced)
    torch.testing.assert_close(fixed.cpu(), _reference(x, codes, scale_inv, scale_row, 64), **tol(torch.float32))


@pytest.mark.parametrize("m", [3, 17])
def test_fp8_mid_gated_equals_the_gemm_then_silu(m, device):
    """Gate and up rows in different scale blocks (parts 40 + 40 in blocks of 16: each row its own scale row),
    paired per program; the epilogue's `silu(gate) * up` equals the plain kernel's output through SiLU-and-mul."""
    codes, scale_inv, scale_row = fp8_operands([40, 40], 128, (16, 64), device)
    x = activations(m, 128, torch.bfloat16, device)
    config = G.MidConfig(16, 64, 4, 2)
    y = F8.fp8_block_linear_silu_mul(x, codes, scale_inv, scale_row, 64, config=config)
    assert y.shape == (m, 40) and y.dtype == torch.bfloat16
    expected = ref_silu_and_mul(F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, config=config))
    torch.testing.assert_close(y.float(), expected.float(), **tol(torch.bfloat16))
    reference = ref_silu_and_mul(_reference(x, codes, scale_inv, scale_row, 64).to(torch.bfloat16))
    torch.testing.assert_close(y.cpu().float(), reference.float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("m,config", [(3, G.MidConfig(32, 128, 4, 1, 2)), (20, G.MidConfig(64, 128, 4, 2))])
def test_fp8_mid_tiles_in_one_scale_block_match_the_general_path_bit_for_bit(m, config, device):
    """Regular 128-row scale blocks (parts 256 + 64: the last block partial, N = 320 a partial column tile) with
    column tiles dividing 128 take one weight scale a group: the per-row path's fp32 products, so its bits."""
    codes, scale_inv, scale_row = fp8_operands([256, 64], 384, (128, 128), device)
    x = activations(m, 384, torch.float32, device) * 3
    xq, xs = F8.fp8_quantize_activation(x, 128)
    run = lambda uniform: G.mid_fp8_linear(  # noqa: E731
        xq, codes, G.BlockScales(xs, scale_inv, scale_row, 128, uniform), x.dtype, config=config)
    assert F8._uniform_tiles(config.block_n, scale_row)
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=config)
    assert torch.equal(y, run(True)) and torch.equal(y, run(False))
    torch.testing.assert_close(y.cpu(), _reference(x, codes, scale_inv, scale_row, 128), **tol(torch.float32))


def test_fp8_mid_refuses_a_k_step_other_than_the_group(device):
    codes, scale_inv, scale_row = fp8_operands([32], 128, (16, 64), device)
    x = activations(4, 128, torch.float32, device)
    with pytest.raises(ValueError, match="groups of 64"):
        F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, config=G.MidConfig(16, 32, 4, 1))


def test_fp8_takes_the_mid_table_entry_of_its_group(monkeypatch, device):
    """`fp8_block_linear` and the gated op ask the mid table for their FP8 ops; an entry whose K step is not the
    group, or no entry, leaves the FP8 kernels (the gated op then runs the GEMM and the SiLU-and-mul kernel)."""
    table = {("fp8_linear", 8, 64, 128): G.MidConfig(16, 64, 4, 1, 2),
             ("fp8_linear_silu_mul", 8, 64, 128): G.MidConfig(16, 64, 4, 1),
             ("fp8_linear", 16, 64, 128): G.MidConfig(16, 32, 4, 1)}
    monkeypatch.setattr(G, "choose_config", lambda op, m, n, k, device: table.get((op, G.m_bucket(m), n, k)))
    launched = []
    real = G.mid_fp8_linear
    monkeypatch.setattr(G, "mid_fp8_linear", lambda *a, **kw: launched.append(kw["gated"]) or real(*a, **kw))
    codes, scale_inv, scale_row = fp8_operands([64], 128, (16, 64), device)
    for m, expected in ((6, [False]), (12, [])):
        x = activations(m, 128, torch.float32, device)
        y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64)
        assert launched == expected
        torch.testing.assert_close(y.cpu(), _reference(x, codes, scale_inv, scale_row, 64), **tol(torch.float32))
        launched.clear()
    x = activations(6, 128, torch.float32, device)
    ref = _reference(x, codes, scale_inv, scale_row, 64)
    gated = F8.fp8_block_linear_silu_mul(x, codes, scale_inv, scale_row, 64)
    assert launched == [True]
    torch.testing.assert_close(gated.cpu(), ref_silu_and_mul(ref), **tol(torch.float32))
    launched.clear()
    gated = F8.fp8_block_linear_silu_mul(activations(12, 128, torch.float32, device), codes, scale_inv, scale_row, 64)
    assert launched == [] and gated.shape == (12, 32)


def test_fp8_linear_ops_gated_op_equals_the_norm_gemm_and_silu(monkeypatch, device):
    """The FP8 `LinearOps`' gate / up op through the mid GEMM's epilogue: the norm's output and the new residual
    as the unfused ops give them, the activation within bf16 rounding of SiLU-and-mul of the GEMM."""
    from infer_backend_cuda.linear_ops import Fp8BlockLinearOps
    from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
    from infer_core.quant import QuantScheme

    monkeypatch.setattr(G, "choose_config", lambda op, m, n, k, device: G.MidConfig(16, 64, 4, 1))
    scheme = QuantScheme.fp8_block(16, 64)
    fused = TritonFusedOps(CudaMathOps())
    ops = Fp8BlockLinearOps(fused, scheme)
    weight = fp8_operands([48, 48], 128, (16, 64), device)
    x = activations(10, 128, torch.bfloat16, device)
    residual = activations(10, 128, torch.bfloat16, device, 3)
    norm_weight = activations(128, 1, torch.bfloat16, device, 4).reshape(128)
    act, h = ops.add_rms_norm_linear_silu_mul(x, residual, norm_weight, 1e-6, weight, None)
    out, h_ref = ops.add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, None)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(act.float(), ref_silu_and_mul(out).float(), **tol(torch.bfloat16))


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 9, 33, 64, 128])
def test_fp8_mid_qwen3_4b_shapes_on_gpu(m):
    """Every tile form the tuner tries for FP8, at Qwen3-4B's decode shapes, against the W8A8 reference."""
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        codes, scale_inv, scale_row = fp8_operands([n], k, (128, 128), "cuda", seed=n)
        x = activations(m, k, torch.bfloat16, "cuda")
        ref = _reference(x, codes, scale_inv, scale_row, 128).float()
        for config in (G.MidConfig(64, 128, 4, 4), G.MidConfig(128, 128, 8, 3, 4), G.MidConfig(64, 128, 4, 6, 3)):
            y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=config)
            torch.testing.assert_close(y.float().cpu(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 128])
def test_fp8_mid_gated_and_split_k_replay_in_a_cuda_graph(m):
    """The gated gate / up op and the split-K o_proj inside CUDA graphs: replays give the eager answer on new
    inputs; the gated output equals the plain kernel's through SiLU-and-mul."""
    split_k.allocate_counters(torch.device("cuda"))
    gate_up = fp8_operands([9728, 9728], 2560, (128, 128), "cuda", seed=1)
    o_proj = fp8_operands([2560], 4096, (128, 128), "cuda", seed=2)
    x1, x2 = activations(m, 2560, torch.bfloat16, "cuda"), activations(m, 4096, torch.bfloat16, "cuda")
    gated_cfg, split_cfg = G.MidConfig(64, 128, 4, 3), G.MidConfig(64, 128, 4, 4, 3)
    run = lambda: (F8.fp8_block_linear_silu_mul(x1, *gate_up, 128, config=gated_cfg),  # noqa: E731
                   F8.fp8_block_linear(x2, *o_proj, 128, config=split_cfg))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x1.copy_(activations(m, 2560, torch.bfloat16, "cuda", seed=5))
    x2.copy_(activations(m, 4096, torch.bfloat16, "cuda", seed=6))
    graph.replay()
    expected = run()
    torch.cuda.synchronize()
    assert all(torch.equal(c, e) for c, e in zip(captured, expected))
    plain = F8.fp8_block_linear(x1, *gate_up, 128, config=gated_cfg)
    torch.testing.assert_close(expected[0], ref_silu_and_mul(plain), atol=0, rtol=0)
