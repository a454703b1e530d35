"""RMSNorm, fused add + RMSNorm and SiLU-and-mul against plain torch."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels._common import interpreting
from tests.backend_cuda.conftest import gpu, poison, tol
from tests.backend_cuda.reference import ref_add_rms_norm, ref_rms_norm, ref_silu_and_mul

INTERPRETING = interpreting()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_SHAPES = [(1, 16), (5, 48), (3, 2, 100)] + [
    pytest.param(s, marks=gpu) for s in [(257, 2560), (64, 4096), (7, 8192), (1, 12288)]
]


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape, dtype, device):
    x = _rand(shape, dtype, device, 1)
    w = _rand(shape[-1:], dtype, device, 2)
    out = poison(torch.empty_like(x))
    y = K.rms_norm(x, w, 1e-6, out=out)
    assert y is out
    torch.testing.assert_close(y.float(), ref_rms_norm(x, w, 1e-6).float(), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm(shape, dtype, device):
    x = _rand(shape, dtype, device, 3)
    r = _rand(shape, dtype, device, 4)
    w = _rand(shape[-1:], dtype, device, 5)
    x0, r0 = x.clone(), r.clone()
    out, rout = poison(torch.empty_like(x)), poison(torch.empty_like(r))
    y, new_r = K.add_rms_norm(x, r, w, 1e-5, out=out, residual_out=rout)
    ref_y, ref_r = ref_add_rms_norm(x, r, w, 1e-5)
    # Exact on a GPU; Triton's interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even).
    exact = dict(atol=0, rtol=1e-2 if (INTERPRETING and dtype == torch.bfloat16) else 0)
    torch.testing.assert_close(new_r.float(), ref_r.float(), **exact)
    torch.testing.assert_close(y.float(), ref_y.float(), **tol(dtype))
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


def test_add_rms_norm_in_place_and_strided_rows(device):
    """residual_out=residual updates in place; x may be a row-strided view (e.g. a slice of a wider GEMM
    output)."""
    wide = _rand((6, 80), torch.float32, device, 6)
    x = wide[:, :32]
    r = _rand((6, 32), torch.float32, device, 7)
    w = _rand((32,), torch.float32, device, 8)
    ref_y, ref_r = ref_add_rms_norm(x, r, w, 1e-6)
    y, new_r = K.add_rms_norm(x, r, w, 1e-6, residual_out=r)
    assert new_r.data_ptr() == r.data_ptr()
    torch.testing.assert_close(new_r, ref_r)
    torch.testing.assert_close(y, ref_y, **tol(torch.float32))
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 32), (7, 2 * 40), (2, 3, 2 * 24)] + [pytest.param(s, marks=gpu) for s in [(129, 2 * 9728), (1, 2 * 3072)]]
)
def test_silu_and_mul(shape, dtype, device):
    gu = _rand(shape, dtype, device, 9)
    out = poison(torch.empty((*shape[:-1], shape[-1] // 2), dtype=dtype, device=device))
    y = K.silu_and_mul(gu, out=out)
    assert y is out
    torch.testing.assert_close(y.float(), ref_silu_and_mul(gu).float(), **tol(dtype))


def test_empty_batch(device):
    x = torch.empty((0, 16), device=device)
    w = torch.ones(16, device=device)
    assert K.rms_norm(x, w, 1e-6).shape == (0, 16)
    assert K.silu_and_mul(torch.empty((0, 32), device=device)).shape == (0, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 2, 8), (5, 3, 24)] + [pytest.param(257, 16, 256, marks=gpu)])
def test_sigmoid_gate_mul_reads_the_gate_in_place_and_rounds_as_torch(tokens, heads, dim, dtype, device):
    """The gate as attention.py hands it over: every other head-sized slice of a `[T, H, 2, D]` projection."""
    x = _rand((tokens, heads, dim), dtype, device, 7)
    projected = _rand((tokens, heads, 2, dim), dtype, device, 8)
    gate = projected.unbind(dim=2)[1]
    assert not gate.is_contiguous()
    out = poison(torch.empty_like(x))
    y = K.sigmoid_gate_mul(x, gate, out=out)
    assert y.data_ptr() == out.data_ptr()
    expected = x * torch.sigmoid(gate)  # torch's two ops, each rounded to the dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    else:  # at most one rounding step apart (the sigmoid's last bit), almost always equal; the interpreter's
        # bf16 casts do not round to nearest, so its bf16 is held to the tolerance only
        torch.testing.assert_close(y.float(), expected.float(), **tol(dtype))
        if not (INTERPRETING and dtype == torch.bfloat16):
            assert (y != expected).float().mean().item() < 0.05
    with pytest.raises(ValueError, match="must be equal"):
        K.sigmoid_gate_mul(x, gate[:, :1])
