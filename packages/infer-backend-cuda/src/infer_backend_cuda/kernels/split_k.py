"""Split-K for the skinny (decode) GEMMs: how many K ranges to cut, and the fixed-order sum of their partials.

A decode GEMM with one program per column tile launches N / BLOCK_N programs (20 for N = 2560 at 128 columns),
about a seventh of an H200's 132 SMs, each walking all of K: latency-bound, far from the HBM floor. Cutting K
into ranges gives a few programs per SM; each writes fp32 partial sums to a workspace `[splits, M, N]`, and one
small kernel adds them in split order (deterministic, unlike atomics) with the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch

# A few programs per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 512


def num_splits(k_steps: int, column_tiles: int) -> int:
    """How many K ranges to ask for, given `k_steps` K steps of a program and `column_tiles` programs per split."""
    return max(1, min(k_steps, TARGET_PROGRAMS // max(1, column_tiles)))


def steps_per_split(k_steps: int, splits: int) -> tuple[int, int]:
    """(K steps per range, number of ranges) for at most `splits` ranges that each hold whole steps."""
    per = triton.cdiv(k_steps, max(1, splits))
    return per, triton.cdiv(k_steps, per)


@triton.jit
def store_tile(acc, out_ptr, b_ptr, rm, cols, m_mask, n_mask, N, out_stride, split_stride, split,
               PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A program's fp32 tile `acc [rows rm, columns cols]`: with PARTIAL, range `split`'s partial sums into the
    workspace (`out_ptr + split * split_stride`, rows N apart; the bias waits for the sum); else, plus the bias,
    the output in its dtype."""
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + split * split_stride + rm[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _split_reduce_kernel(ws_ptr, b_ptr, out_ptr, N, out_stride, split_stride,
                         SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: start early, read the partials only after the GEMM ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m, pid = tl.program_id(0), tl.program_id(1)
    rn = pid * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * split_stride + m * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * out_stride + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def workspace(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((splits, m, n), dtype=torch.float32, device=device)


def reduce_splits(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """`out = sum(ws, dim=0) (+ bias)` in out's dtype; ws `[splits, M, N]` fp32 contiguous."""
    splits, m, n = ws.shape
    block = min(1024, next_pow2(n))
    _split_reduce_kernel[(m, triton.cdiv(n, block))](
        ws, bias if bias is not None else ws, out, n, out.stride(0), m * n,
        SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_launch(out.device),
    )
