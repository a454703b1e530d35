"""RMSNorm and fused residual-add + RMSNorm (one program per row).

Fuses: `residual = x + residual` (rounded to the residual dtype, exactly as the unfused op would store
it), the fp32 sum of squares, `rsqrt`, the weight multiply and the cast back, in one pass over the row:
read x (+ residual) and weight once, write the normed row (+ the new residual) once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, norm_num_warps, pdl_launch, rows_view


@triton.jit
def add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, n_rows, x_stride, res_stride, res_out_stride, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                     PADDED: tl.constexpr):
    """One row's `x (+ residual) -> rms_norm * w` in fp32 `[BLOCK]` (zeros past H), the new residual stored. With
    PADDED a row at or past `n_rows` (padding) reads zeros and stores nothing (without it the norm kernel compiles
    as before the helper existed). Waits for the producer under PDL."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # The weight first, before waiting for the producer (no kernel writes it): loaded after the residual's store
    # it would take a round trip of its own (a load may not move above a store it could alias).
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if PADDED:
        mask = mask & (cols * 0 + row < n_rows)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
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
    row = tl.program_id(0).to(tl.int64)
    y = add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, 0, x_stride, res_stride, res_out_stride, H,
                         eps, HAS_RESIDUAL, BLOCK, USE_PDL, False)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=cols < H)


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
