"""W4A16 GEMMs for AutoAWQ "gemm" weights, dequantizing in registers: `out = x @ ((q - z) * s) (+ bias)`.

`qweight` int32 `[K, N/8]`, `qzeros` int32 `[K/group, N/8]`, `scales` fp16 `[K/group, N]`; column c of a group of
eight sits in nibble `[0, 4, 1, 5, 2, 6, 3, 7][c]` of its word, i.e. at bit `4 * ((c % 2) * 4 + c // 2)`. Each K
step stays inside one group (`BLOCK_K` divides the group), so a tile reads one row of zero points and scales.

Two kernels: a tiled `tl.dot` GEMM for prefill, and for decode (<= 8 rows) a skinny kernel whose programs each
stream `BLOCK_N` columns of the packed weight over one range of K (split-K, so that a decode GEMM launches a few
programs per SM) with the products on the CUDA cores; a second small kernel sums the ranges in a fixed order. Dequantized weights
are rounded to the activation dtype before the product, as the CPU reference's dequantized GEMM does.
Launch configs: a shape heuristic (a tuning table like the skinny GEMM's can come later).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import split_k
from infer_backend_cuda.kernels._common import check_last_dim_contiguous, dot_in_fp32, next_pow2

SKINNY_MAX_M = 8


class AwqConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    k_splits: int = 1  # skinny kernel only: K is cut into this many ranges (at most), summed by a second kernel



@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, kk, rn, g, N, K, qw_stride, qz_stride, s_stride):
    """The fp32 weight tile `[BLOCK_K, BLOCK_N]` of rows `kk` (one group `g`) and columns `rn`."""
    c = rn % 8
    shift = ((c % 2) * 4 + c // 2) * 4
    n_mask = rn < N
    words = tl.load(qw_ptr + kk.to(tl.int64)[:, None] * qw_stride + (rn // 8)[None, :],
                    mask=(kk < K)[:, None] & n_mask[None, :], other=0)
    q = (words >> shift[None, :]) & 0xF
    z = (tl.load(qz_ptr + g * qz_stride + rn // 8, mask=n_mask, other=0) >> shift) & 0xF
    s = tl.load(s_ptr + g * s_stride + rn, mask=n_mask, other=0.0).to(tl.float32)
    return (q - z[None, :]).to(tl.float32) * s[None, :]


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, x_stride, qw_stride, qz_stride, s_stride, out_stride,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * x_stride + kk[None, :],
                    mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, kk, rn, k0 // GROUP, N, K, qw_stride, qz_stride, s_stride)
        w = w.to(x_ptr.dtype.element_ty)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (rn < N)[None, :])


@triton.jit
def _awq_skinny_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, x_stride, qw_stride, qz_stride, s_stride, out_stride, split_stride,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, K_SPLIT: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (n, s) covers columns `n * BLOCK_N` and rows `[s * K_SPLIT, (s + 1) * K_SPLIT)` of K. With PARTIAL
    it writes fp32 partial sums to `out_ptr + s * split_stride` (a split-K workspace, see split_k.py)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * K_SPLIT
    # The last range stops at K: past it the group index would read scale and zero rows that do not exist (seen
    # on the H200: NaN partials, then an illegal address), which the masked activations cannot cancel (0 * NaN).
    for k0 in range(k_first, tl.minimum(k_first + K_SPLIT, K), BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * x_stride + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, kk, rn, k0 // GROUP, N, K, qw_stride, qz_stride, s_stride)
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    mask = m_mask[:, None] & (rn < N)[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * split_stride + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def group_block_k(group: int, cap: int) -> int:
    """The largest power of two <= cap dividing `group`: a K step that never straddles two groups."""
    block = 1
    while block * 2 <= cap and group % (block * 2) == 0:
        block *= 2
    return block


def check_group(group: int) -> None:
    if group_block_k(group, 16) < 16:
        raise ValueError(f"the cuda AWQ kernels need a group size divisible by 16, got {group}")


def default_config(m: int, n: int, k: int, group: int) -> AwqConfig:
    """Decode: ~8K fp32 products per K step and program. Prefill: 64-128 row tiles on the tensor cores."""
    if m <= SKINNY_MAX_M:
        bm = next_pow2(m)
        block_k = group_block_k(group, 32)
        block_n = max(16, min(128, 8192 // (bm * block_k)))
        return AwqConfig(bm, block_n, block_k, 4, 2, split_k.num_splits(k // block_k, -(-n // block_n)))
    return AwqConfig(64 if m <= 64 else 128, 128, group_block_k(group, 64), 8 if m > 64 else 4, 3)


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: AwqConfig | None = None,
) -> torch.Tensor:
    """`x [M, K] @ dequant(qweight, qzeros, scales) (+ bias)` -> `[M, N]` in x's dtype; the skinny kernel for
    `M <= 8`, the tiled GEMM otherwise."""
    if x.dim() != 2 or qweight.shape[0] != x.shape[1] or scales.shape[1] != qweight.shape[1] * 8:
        raise ValueError(f"AWQ GEMM: input {tuple(x.shape)}, qweight {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} do not match")
    m, k = x.shape
    n = scales.shape[1]
    group = k // scales.shape[0]
    check_group(group)
    check_last_dim_contiguous("input", x)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = config or default_config(m, n, k, group)
    if group % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide the group size {group}")
    if m <= SKINNY_MAX_M and cfg.block_m >= m and cfg.block_m <= SKINNY_MAX_M:
        _skinny(x, qweight, qzeros, scales, bias, out, group, cfg)
    else:
        _awq_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
            x, qweight, qzeros, scales, bias if bias is not None else scales, out, m, n, k, x.stride(0),
            qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
            GROUP=group, HAS_BIAS=bias is not None, DOT_F32=dot_in_fp32(x.dtype), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


def _skinny(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, group: int, cfg: AwqConfig) -> None:
    """The decode kernel, split over K when the config asks: each range whole BLOCK_K steps (so a step stays in
    one group)."""
    m, k = x.shape
    n = out.shape[1]
    steps, splits = split_k.steps_per_split(triton.cdiv(k, cfg.block_k), cfg.k_splits)
    partial = splits > 1
    target = split_k.workspace(splits, m, n, x.device) if partial else out
    _awq_skinny_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, target, m, n, k, x.stride(0),
        qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0), m * n,
        GROUP=group, HAS_BIAS=bias is not None, K_SPLIT=steps * cfg.block_k, PARTIAL=partial, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        split_k.reduce_splits(target, bias, out)
