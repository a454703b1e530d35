"""RMSNorm and fused residual-add + RMSNorm (one program per row).

Fuses: `residual = x + residual` (rounded to the residual dtype, exactly as the unfused op would store
it), the fp32 sum of squares, `rsqrt`, the weight multiply and the cast back, in one pass over the row:
read x (+ residual) and weight once, write the normed row (+ the new residual) once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import interpreting, next_pow2, norm_num_warps, pdl_launch, rows_view
from infer_backend_cuda.kernels.fp8_gemm import quantize_groups


@triton.jit
def _normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, x_stride, res_stride, res_out_stride, H, eps, mask, cols,
                HAS_RESIDUAL: tl.constexpr):
    """Row `row`'s RMSNorm in fp32 (before the cast to the output dtype); with HAS_RESIDUAL it first stores the new
    residual `x + residual`, rounded to the residual dtype, and normalizes that rounded sum."""
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * rstd * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    y = _normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, x_stride, res_stride, res_out_stride, H, eps, mask, cols,
                    HAS_RESIDUAL)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, M, x_stride, res_stride, res_out_stride, q_stride, s_row_stride,
    s_group_stride, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The norm, rounded to the input dtype (what the unfused norm stores), then quantized to e4m3 per row and
    `GROUP` columns as `fp8_gemm.fp8_quantize_activation` does: the same codes and scales, one launch and the
    normed row's round trip fewer. Rows from M (padding of the cuBLASLt path) are zero rows: codes 0, scale 1."""
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    if row < M:
        y = _normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, x_stride, res_stride, res_out_stride, H, eps, mask,
                        cols, HAS_RESIDUAL).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = tl.zeros((BLOCK,), tl.float32)
    codes, scale = quantize_groups(tl.reshape(y, (BLOCK // GROUP, GROUP)), ROUND_IN_FP32)
    tl.store(q_ptr + row * q_stride + cols, tl.reshape(codes, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=mask)
    groups = tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * s_row_stride + groups * s_group_stride, scale, mask=groups * GROUP < H)


def _launch(x2, r2, weight, out2, rout2, eps: float) -> None:
    n_rows, hidden = x2.shape
    if n_rows == 0:
        return
    if weight.shape[-1] != hidden or weight.stride(-1) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] vector, got {tuple(weight.shape)}")
    block = next_pow2(hidden)
    has_res = r2 is not None
    _rms_norm_kernel[(n_rows,)](
        x2,
        r2 if has_res else x2,
        weight,
        out2,
        rout2 if has_res else out2,
        x2.stride(0),
        r2.stride(0) if has_res else 0,
        out2.stride(0),
        rout2.stride(0) if has_res else 0,
        hidden,
        float(eps),
        HAS_RESIDUAL=has_res,
        BLOCK=block,
        num_warps=norm_num_warps(block),
        **pdl_launch(x2.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * weight`, fp32 inside, `x.dtype` out."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = rows_view(x)
    out2 = out.view(-1, x.shape[-1])
    _launch(x2, None, weight, out2, None, eps)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return rms_norm(residual), residual`.

    The inputs are not modified: the new residual goes to `residual_out` (a fresh tensor by default; pass
    `residual_out=residual` to update in place, which is safe because each element is read before it is
    written by the same program).
    """
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    hidden = x.shape[-1]
    _launch(rows_view(x), rows_view(residual), weight, out.view(-1, hidden), residual_out.view(-1, hidden), eps)
    return out, residual_out


def add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`rms_norm(x + residual)` (or of `x` alone) quantized into `codes [R, K]` (e4m3) and `scales [R, ceil(K /
    group)]` (fp32, any strides; R >= the rows of x, the rows past them zero rows) as `fp8_quantize_activation`
    would quantize the unfused norm's output; returns the new residual (in `residual_out` if given), or None
    without one."""
    x2 = rows_view(x)
    m, hidden = x2.shape
    rows, groups = codes.shape[0], -(-hidden // group)
    if weight.shape[-1] != hidden or weight.stride(-1) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] vector, got {tuple(weight.shape)}")
    if codes.shape[1] != hidden or rows < m or scales.shape != (rows, groups) or codes.stride(1) != 1:
        raise ValueError(f"FP8 norm: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} for input "
                         f"{tuple(x2.shape)} in groups of {group}")
    r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
        if residual_out is None:
            residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        r2 = rows_view(residual)
    rout2 = residual_out.view(-1, hidden) if r2 is not None else None
    block = max(next_pow2(hidden), group)
    if rows:
        _rms_norm_fp8_kernel[(rows,)](
            x2, r2 if r2 is not None else x2, weight, codes, scales, rout2 if rout2 is not None else x2, m,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, rout2.stride(0) if rout2 is not None else 0,
            codes.stride(0), scales.stride(0), scales.stride(1), hidden, float(eps),
            HAS_RESIDUAL=r2 is not None, BLOCK=block, GROUP=group, ROUND_IN_FP32=interpreting(),
            num_warps=norm_num_warps(block), **pdl_launch(x2.device),
        )
    return residual_out
