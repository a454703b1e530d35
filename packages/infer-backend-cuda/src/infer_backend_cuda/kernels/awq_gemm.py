"""W4A16 GEMMs for AutoAWQ "gemm" weights, dequantizing in registers: `out = x @ ((q - z) * s) (+ bias)`.

`qweight` int32 `[K, N/8]`, `qzeros` int32 `[K/group, N/8]`, `scales` fp16 `[K/group, N]`; column c of a group of
eight sits in nibble `[0, 4, 1, 5, 2, 6, 3, 7][c]` of its word, i.e. at bit `4 * ((c % 2) * 4 + c // 2)`. Each K
step stays inside one group (`BLOCK_K` divides the group), so a tile reads one row of zero points and scales.

One kernel: each program streams a `[BLOCK_K, BLOCK_N / 8]` tile of packed words per K step, reading each word
once, unpacks it in registers and multiplies on the tensor cores (`tl.dot`, 16+ row tiles; the default at
every row count) or on the CUDA cores (a config of <= 8 rows). K may be split into ranges (so that a decode
GEMM launches a few programs per SM); a second small kernel sums the ranges in a fixed order. Dequantized
weights are rounded to the activation dtype before the product, as the CPU reference's dequantized GEMM does.
Launch configs: a shape heuristic (`scripts/bench_quant_gemm.py` times alternatives on a GPU).
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
    k_splits: int = 1  # K is cut into this many ranges (at most), summed by a second kernel (split_k.py)



@triton.jit
def _field(words, i: tl.constexpr):
    """Nibble `i` of each word as the fp32 `2^23 + code * 16^e` (`e = i`, or `i - 3` from nibble 5): masked in
    place (no shift: the nibble sits in the mantissa of 2^23, an exact int -> float conversion without the slow
    cvt) for the five low nibbles; the three high ones after one shared shift by 12 bits. The power of 16
    cancels against the column's scale (`_column_unscale`), exactly."""
    if i >= 5:
        words = words >> 12
        e: tl.constexpr = i - 3
    else:
        e: tl.constexpr = i
    return ((words & (0xF << (4 * e))) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _unpack(words, BLOCK_N: tl.constexpr):
    """int32 words `[R, BLOCK_N / 8]` -> fp32 `[R, BLOCK_N]` of `_field`s in column order. Column `c` of a word is
    nibble `4 (c % 2) + c // 2`; joined as a tree (each join adds a minor dimension, held in registers) the eight
    fields of a word land in one thread's registers in column order, so that the reshape and the loads and
    stores of whole column runs need no data movement."""
    lo = tl.join(tl.join(_field(words, 0), _field(words, 2)), tl.join(_field(words, 1), _field(words, 3)))
    hi = tl.join(tl.join(_field(words, 4), _field(words, 6)), tl.join(_field(words, 5), _field(words, 7)))
    return tl.reshape(tl.join(lo, hi), [words.shape[0], BLOCK_N])


@triton.jit
def _column_unscale(cols):
    """`16^-e` of each column's field (see `_field`): column c holds nibble `4 (c % 2) + c // 2` of its word."""
    nibble = (cols % 2) * 4 + (cols % 8) // 2
    return tl.exp2(-4.0 * tl.where(nibble >= 5, nibble - 3, nibble).to(tl.float32))


@triton.jit
def _awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, x_stride, qw_stride, qz_stride, s_stride, out_stride, split_stride,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, K_SPLIT: tl.constexpr, PARTIAL: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n, s) covers rows `m * BLOCK_M`, columns `n * BLOCK_N` and K `[s * K_SPLIT, (s + 1) * K_SPLIT)`;
    with PARTIAL it writes fp32 partial sums to `out_ptr + s * split_stride` (a split-K workspace, split_k.py).

    Each K step loads the packed words `[BLOCK_K, BLOCK_N / 8]` once (contiguous rows) and unpacks them in
    registers (`_unpack`)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_W: tl.constexpr = BLOCK_N // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    rk = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, w_mask, n_mask = rm < M, rw < N // 8, cols < N
    unscale = _column_unscale(cols)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * K_SPLIT
    # The last range stops at K: past it the group index would read scale and zero rows that do not exist (seen
    # on the H200: NaN partials, then an illegal address), which the masked activations cannot cancel (0 * NaN).
    k_end = tl.minimum(k_first + K_SPLIT, K)
    w_ptrs = qw_ptr + (k_first + rk)[:, None] * qw_stride + rw[None, :]
    # Triton pipelines only the loads that feed a tl.dot; the words are loaded one step ahead by hand so that
    # the CUDA-core path, too, has the next tile in flight while it unpacks this one.
    words_next = tl.load(w_ptrs, mask=((k_first + rk) < k_end)[:, None] & w_mask[None, :], other=0,
                         eviction_policy="evict_first")
    for k0 in range(k_first, k_end, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = words_next
        w_ptrs += BLOCK_K * qw_stride
        words_next = tl.load(w_ptrs, mask=((kk + BLOCK_K) < k_end)[:, None] & w_mask[None, :], other=0,
                             eviction_policy="evict_first")
        g = k0 // GROUP
        zeros = tl.load(qz_ptr + g * qz_stride + rw, mask=w_mask, other=0)
        s = tl.load(s_ptr + g * s_stride + cols, mask=n_mask, other=0.0).to(tl.float32) * unscale
        # ((q - z) 16^e) (s 16^-e) = (q - z) s, exact in fp32 (a 5-bit integer times an fp16 scale; the powers of
        # two only move exponents), then rounded to x's dtype as the reference's dequantized GEMM does.
        w = ((_unpack(words, BLOCK_N) - _unpack(zeros[None, :], BLOCK_N)) * s[None, :]).to(x.dtype)
        if USE_DOT:
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        else:
            acc3 += x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=1)
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * split_stride + rm[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


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
    """The tensor cores at every row count (16-row tiles at decode, up to 64 or 128 for prefill): a padded
    `tl.dot` costs less than one row's CUDA-core products, which issue ~2x the instructions per weight (sm_90
    SASS of this kernel: ~9.5 against ~18 per dequantized weight). K is split to fill the GPU, but only while
    the fp32 workspace traffic (`16 * M * splits / K` of the int4 weight's bytes) stays within a quarter."""
    if m <= 64:
        bm, warps = max(16, next_pow2(m)), 4
    else:
        bm, warps = 128, 8
    block_n, block_k = 128, group_block_k(group, 64)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    splits = min(split_k.num_splits(k // block_k, tiles), max(1, k // (64 * m)))
    return AwqConfig(bm, block_n, block_k, warps, 3, splits)


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: AwqConfig | None = None,
) -> torch.Tensor:
    """`x [M, K] @ dequant(qweight, qzeros, scales) (+ bias)` -> `[M, N]` in x's dtype. A config's `block_m`
    picks the product: <= 8 rows on the CUDA cores, >= 16 on the tensor cores (`tl.dot`)."""
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
    if cfg.block_n % 8:
        raise ValueError(f"block_n {cfg.block_n} must be a multiple of 8 (whole packed words)")
    use_dot = cfg.block_m > SKINNY_MAX_M
    if not use_dot and cfg.block_m < m:
        raise ValueError(f"a CUDA-core config covers at most block_m = {cfg.block_m} rows, got {m}")
    steps, splits = split_k.steps_per_split(triton.cdiv(k, cfg.block_k), cfg.k_splits)
    partial = splits > 1
    target = split_k.workspace(splits, m, n, x.device) if partial else out
    _awq_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, target, m, n, k, x.stride(0),
        qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0), m * n,
        GROUP=group, HAS_BIAS=bias is not None, K_SPLIT=steps * cfg.block_k, PARTIAL=partial, USE_DOT=use_dot,
        DOT_F32=dot_in_fp32(x.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        split_k.reduce_splits(target, bias, out)
    return out
