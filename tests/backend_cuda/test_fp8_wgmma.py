"""The Gluon block-FP8 GEMM (kernels/fp8_wgmma.py): its overlap of MMA and promotion, compiled for sm_90 without a
GPU (Gluon kernels do not run under the interpreter); on the GPU, against the W8A8 reference and the mid GEMM."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from infer_backend_cpu.quant_math import fp8_block_linear as ref_fp8_linear
from infer_backend_cuda.kernels import fp8_gemm as F8
from infer_backend_cuda.kernels import fp8_wgmma as W
from infer_backend_cuda.kernels import mid_gemm as G
from tests.backend_cuda.conftest import gpu, needs_cuda, poison
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, fp8_operands

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}


@pytest.mark.parametrize("m", [16, 128])
def test_the_promotion_runs_while_the_next_group_multiplies(m):
    """The loop waits for the wgmma groups with one still in flight (`wgmma.wait_group 1`), which Triton's own
    pipeliner never emits for this sum (it waits for 0 after every fp8 dot); and at 128 rows, the three
    accumulator-sized values live across that wait fit the registers: no spill."""
    kernel = W.compile_sm90(m, 19456, 2560)
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", kernel.asm["ptx"]))
    assert waits == {"0", "1"}
    resources = _resources(kernel.asm["cubin"])
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0 and resources["REG"] <= 232


def test_refuses_what_it_does_not_cover():
    codes = torch.empty((129, 256), dtype=torch.float8_e4m3fn)
    weight = torch.empty((64, 256), dtype=torch.float8_e4m3fn)
    scales = torch.empty((129, 2))
    with pytest.raises(ValueError, match="M 129"):
        W.fp8_wgmma_linear(codes, scales, weight, torch.empty((1, 2)), torch.zeros(64, dtype=torch.int32),
                           torch.bfloat16)
    with pytest.raises(ValueError, match="group stride of 1"):
        W.fp8_wgmma_linear(codes[:8], torch.empty((2, 8)).t(), weight, torch.empty((1, 2)),
                           torch.zeros(64, dtype=torch.int32), torch.bfloat16)


def _wgmma(x, codes, scale_inv, scale_row, out=None):
    q, s = F8.fp8_quantize_activation(x, 128)
    return W.fp8_wgmma_linear(q, s, codes, scale_inv, scale_row, x.dtype, out=out)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 33, 64, 100, 128])
def test_qwen3_4b_shapes_against_the_w8a8_reference_and_the_mid_gemm(m):
    """Rows of magnitudes 1e-2..1e2 and a zero row; the same sums as the mid GEMM's block-scaled program, so the
    two agree far closer than either with the reference's fp32 order."""
    for n, k in QWEN3_4B:
        codes, scale_inv, scale_row = fp8_operands([n], k, (128, 128), "cuda", seed=n)
        x = activations(m, k, torch.float32, "cuda") * torch.logspace(-2, 2, m).reshape(m, 1).to("cuda")
        x[m // 2] = 0
        x = x.to(torch.bfloat16)
        y = _wgmma(x, codes, scale_inv, scale_row, out=poison(torch.empty((m, n), dtype=torch.bfloat16,
                                                                          device="cuda")))
        ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None).float()
        torch.testing.assert_close(y.float().cpu(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
        mid = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=G.MidConfig(64, 128, 4, 4))
        torch.testing.assert_close(y, mid, atol=2e-3 * mid.float().abs().max().item(), rtol=1e-2)
        assert torch.all(y[m // 2] == 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 128])
def test_replays_in_a_cuda_graph(m):
    """Captured once (the TMA descriptors are kernel parameters), replayed on new inputs: the eager answer."""
    codes, scale_inv, scale_row = fp8_operands([19456], 2560, (128, 128), "cuda", seed=3)
    x = activations(m, 2560, torch.bfloat16, "cuda")
    _wgmma(x, codes, scale_inv, scale_row)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _wgmma(x, codes, scale_inv, scale_row)
    x.copy_(activations(m, 2560, torch.bfloat16, "cuda", seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _wgmma(x, codes, scale_inv, scale_row))
