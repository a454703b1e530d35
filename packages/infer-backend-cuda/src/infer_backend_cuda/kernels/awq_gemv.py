"""The AWQ W4A16 GEMV for decode (M <= 8 rows): CUDA-core products over wide column blocks, split over K by
whole groups (`split_k.py`), the zero point and scale taken out of the inner loop.

A decode GEMM is a weight stream: at 4.2 TB/s an H200 SM must consume ~32 int4 weights a clock, leaving ~4
issued thread-instructions per weight. Two things bound the tiled kernel (`awq_gemm.py`) far above that: its
`[BLOCK_K, BLOCK_N / 8]` word tiles of 64-128 columns read 32-64 bytes per K row (rows are N / 2 bytes apart),
and it spends ~9.5 instructions per weight on dequantizing into a padded 16-row `tl.dot`. Here each program
takes `BLOCK_N` >= 256 columns (one 128-byte line or more per K row) and walks whole groups of K; per weight
the inner loop is one LOP3 (mask the nibble into the mantissa of 2^23, `_awq_nibbles._field`), one FADD and
M FFMAs: the FADD subtracts `2^23 + z * 16^e` of the weight's column, which removes the float bias and the
zero point at once and leaves `(q - z) * 16^e` exactly, so no `z * sum(x)` correction is needed. The group's
products are summed unscaled in a second accumulator and multiplied by `s * 16^-e` once per group.

Numerics: the products use the exact dequantized weight `(q - z) * s` (fp32), not the weight rounded to the
activation dtype as the tiled kernel and the CPU reference do; for bf16 activations the difference is the
reference's own rounding (2^-9 relative a weight, random in sign), well inside the bf16 test tolerance, and
for fp32 activations there is none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import split_k
from infer_backend_cuda.kernels._awq_nibbles import MAGIC, column_block, unpack
from infer_backend_cuda.kernels._common import count_switch, on_off_switch, pdl_launch

# INFER_CUDA_AWQ_PRELOAD (default 1): one-row programs ask for their first group's weights before `gdc_wait`
# (`_one_row_preloaded`); 0 reads every weight after it (A/B runs). Thirty-third session, H100, Qwen3-4B AWQ
# one-row decode replays: 2.378 / 2.372 ms against 2.550 / 2.570 (-7 %).
PRELOAD_ENV = "INFER_CUDA_AWQ_PRELOAD"


def preload_switch(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether one-row programs may ask for their first group's weights before the wait (`preloads` says where)."""
    chosen = on_off_switch(environ, PRELOAD_ENV, "weights asked for before the wait", "after it")
    return True if chosen is None else chosen


PRELOAD = preload_switch()
# INFER_CUDA_AWQ_GEMV_MAXNREG (unset: the compiler's choice): a register cap for the GEMV's launches (A/B runs). The
# one-row preload form takes 168 registers at 128 columns on 2 warps, 6 programs an SM (792 on 132 SMs, fewer than
# qkv's 960 at one row); capped at 128 (64 bytes of stack, ~2 % more instructions a weight; sm_90 SASS) 8 fit.
MAXNREG_ENV = "INFER_CUDA_AWQ_GEMV_MAXNREG"


def maxnreg_switch(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """The launch option for the cap: `{}` when unset, else `{"maxnreg": n}`."""
    cap = count_switch(environ, MAXNREG_ENV, 0, 24, 255, "a register count from 24 to 255")
    return {"maxnreg": cap} if cap else {}


MAXNREG = maxnreg_switch()


@triton.jit
def _step(part, x_ptr, x_rows, qw_ptr, qw_stride, rw, w_mask, m_mask, zero, kk, magic, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """`part += x[:, kk] * ((q - z) 16^e)[kk]` for one K step; `[K step, columns]` at one row, else
    `[rows, K step, columns]` (each thread keeps its own K rows' products: no cross-thread sum in the loop)."""
    words = tl.load(qw_ptr + kk[:, None] * qw_stride + rw[None, :], mask=w_mask[None, :], other=0,
                    eviction_policy="evict_first")
    # (2^23 + q 16^e) - (2^23 + z 16^e) = (q - z) 16^e: exact in fp32 (|q - z| 16^e < 2^24).
    w = unpack(words, BLOCK_N, magic) - zero
    if BLOCK_M == 1:
        part += tl.load(x_ptr + kk).to(tl.float32)[:, None] * w
    else:
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        part += x[:, :, None] * w[None, :, :]
    return part


@triton.jit
def _group_weights(qw_ptr, qw_stride, qz_ptr, qz_stride, s_ptr, s_stride, rw, cols, w_mask, n_mask, rk, g, g_end,
                   GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group `g`'s word tiles (a tuple of its `GROUP / BLOCK_K` K steps), zero words and scales. From `g_end` on no
    word is read (the tiles are 0); the zero words and scales are then group `g_end - 1`'s again (from L2)."""
    words = ()
    for i in tl.static_range(GROUP // BLOCK_K):
        kk = g * GROUP + i * BLOCK_K + rk
        words = words + (tl.load(qw_ptr + kk[:, None] * qw_stride + rw[None, :],
                                 mask=(kk < g_end * GROUP)[:, None] & w_mask[None, :], other=0,
                                 eviction_policy="evict_first"),)
    g = tl.minimum(g, g_end - 1)
    zero_words = tl.load(qz_ptr + g * qz_stride + rw, mask=w_mask, other=0)
    scales = tl.load(s_ptr + g * s_stride + cols, mask=n_mask, other=0.0)
    return words, zero_words, scales


@triton.jit
def _one_row_preloaded(x_ptr, qw_ptr, qz_ptr, s_ptr, qw_stride, qz_stride, s_stride, rw, cols, w_mask, n_mask,
                       unscale, rk, g_first, g_end, magic, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One row's `[BLOCK_K, BLOCK_N]` running sums over groups `[g_first, g_end)`. The weights are constants that
    no kernel writes, so the first group's words, zero words and scales are asked for before `gdc_wait`, while
    the kernel before (norm, attention or GEMV) still runs: at one row the programs cover one or two groups (K
    split to ~512 programs), so that is all or half of their weight stream. Each trip asks for the next group's
    after its products. sm_90 SASS (Triton 3.6): 126 -> 168 registers at 128 columns on 2 warps, the same
    instructions a weight; two groups before the wait took 255 (half the programs resident an SM: not tried)."""
    words, zero_words, scales = _group_weights(qw_ptr, qw_stride, qz_ptr, qz_stride, s_ptr, s_stride, rw, cols,
                                               w_mask, n_mask, rk, g_first, g_end, GROUP, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for g in range(g_first, g_end):
        zero = unpack(zero_words[None, :], BLOCK_N, magic)
        part = tl.zeros_like(acc)
        for i in tl.static_range(GROUP // BLOCK_K):
            w = unpack(words[i], BLOCK_N, magic) - zero
            part += tl.load(x_ptr + g * GROUP + i * BLOCK_K + rk).to(tl.float32)[:, None] * w
        acc += part * (scales.to(tl.float32) * unscale)[None, :]
        words, zero_words, scales = _group_weights(qw_ptr, qw_stride, qz_ptr, qz_stride, s_ptr, s_stride, rw, cols,
                                                   w_mask, n_mask, rk, g + 1, g_end, GROUP, BLOCK_K)
    return acc


@triton.jit
def _groups(x_ptr, x_rows, qw_ptr, qz_ptr, s_ptr, qw_stride, qz_stride, s_stride, rw, cols, w_mask, n_mask, m_mask,
            unscale, rk, g_first, g_end, magic, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """The running sums over groups `[g_first, g_end)`: `[BLOCK_K, BLOCK_N]` at one row, else
    `[BLOCK_M, BLOCK_K, BLOCK_N]`; every load after the kernel's `gdc_wait`."""
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    for g in range(g_first, g_end):
        # Masked columns: words and zero words 0, so the field minus the zero field is 2^23 - 2^23 = 0.
        zero = unpack(tl.load(qz_ptr + g * qz_stride + rw, mask=w_mask, other=0)[None, :], BLOCK_N, magic)
        scale = tl.load(s_ptr + g * s_stride + cols, mask=n_mask, other=0.0).to(tl.float32) * unscale
        part = tl.zeros_like(acc)
        # UNROLL steps at a time, unrolled: their word loads (independent of the products) are in flight
        # together; a rolled loop would have one step's (~1-2 KB a program) waiting on HBM latency at a time.
        for k0 in range(g * GROUP, g * GROUP + GROUP, UNROLL * BLOCK_K):
            for i in tl.static_range(UNROLL):
                part = _step(part, x_ptr, x_rows, qw_ptr, qw_stride, rw, w_mask, m_mask, zero,
                             k0 + i * BLOCK_K + rk, magic, BLOCK_M, BLOCK_N)
        if BLOCK_M == 1:
            acc += part * scale[None, :]
        else:
            acc += part * scale[None, None, :]
    return acc


@triton.jit
def _awq_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, x_stride, qw_stride, qz_stride, s_stride, out_stride, split_stride, groups, groups_per_split, magic,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FIXUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ROW_PROGRAMS: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (n, s) covers every row (with ROW_PROGRAMS program (r, n, s) row r alone), columns `n * BLOCK_N`
    and groups `[s * groups_per_split, ...)`; with PARTIAL it writes fp32 partial sums to `ws_ptr + s *
    split_stride` (a split-K workspace, split_k.py), which with FIXUP the last program of the tile sums into
    `out_ptr` (arrival counter n, or n * M + r with ROW_PROGRAMS).

    `magic` is 0x4B000000 (the bits of 2^23), passed at run time: as a literal, ptxas keeps it as the LOP3's
    immediate and re-materializes the five nibble masks before every LOP3 instead (sm_90 SASS: 5.3 against 4.3
    instructions a weight in the loop, `scripts/sass_census.py`)."""
    if USE_PDL:  # programmatic dependent launch: start early, read x only after its producer ends
        tl.extra.cuda.gdc_launch_dependents()
        if not PRELOAD:
            tl.extra.cuda.gdc_wait()
    if ROW_PROGRAMS:  # one row a program (BLOCK_M 1), the rows of a tile and range neighbours in launch order
        row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        x_ptr += row.to(tl.int64) * x_stride
        tile = pid_n * M + row
    else:
        row, pid_n, pid_k = 0, tl.program_id(0), tl.program_id(1)
        tile = pid_n
    rm, rk = row + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
    rw, cols, w_mask, n_mask, unscale = column_block(pid_n, N, BLOCK_N)
    m_mask = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    g_first = pid_k * groups_per_split
    g_end = tl.minimum(g_first + groups_per_split, groups)
    if PRELOAD:
        acc = _one_row_preloaded(x_ptr, qw_ptr, qz_ptr, s_ptr, qw_stride, qz_stride, s_stride, rw, cols, w_mask,
                                 n_mask, unscale, rk, g_first, g_end, magic, GROUP, BLOCK_N, BLOCK_K, USE_PDL)
    else:
        acc = _groups(x_ptr, x_rows, qw_ptr, qz_ptr, s_ptr, qw_stride, qz_stride, s_stride, rw, cols, w_mask, n_mask,
                      m_mask, unscale, rk, g_first, g_end, magic, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, UNROLL)
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=0)[None, :]
    else:
        y = tl.sum(acc, axis=1)
    split_k.store_tile(y, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask, N, out_stride,
                       split_stride, pid_k, tl.num_programs(2 if ROW_PROGRAMS else 1), tile, PARTIAL, HAS_BIAS, FIXUP)


# The preload's register bound: accumulator elements a thread (`BLOCK_K * BLOCK_N / threads`). sm_90 SASS (Triton 3.6,
# one row, fix-up on): at 16 (8 x 128 on 2 warps, 8 x 64 on 1) 124-127 registers without the preload, 166-168 with
# it; at 32 (the H200 table's one-row gate / up, 16 x 128 on 2 warps) 168 without, 255 with: 4 programs an SM
# instead of 6, a second wave for its 760 programs, so there the weights stay after the wait.
PRELOAD_MAX_ACC_PER_THREAD = 16


def preloads(m: int, row_programs: bool, block_k: int, block_n: int, num_warps: int) -> bool:
    """The kernel's PRELOAD: with the switch on, for one-row programs whose registers fit it."""
    one_row = row_programs or m == 1
    return PRELOAD and one_row and block_k * block_n <= PRELOAD_MAX_ACC_PER_THREAD * 32 * num_warps


def unroll(m: int, steps: int) -> int:
    """K steps unrolled per loop trip (a divisor of the group's `steps`): the whole group at one row (~16-32 KB
    of words in flight a program, 96-168 registers); at more rows the 3-D products take ~250 registers at 4
    steps and spill beyond (sm_90, `scripts/sass_census.py`)."""
    if m == 1:
        return steps
    return max(d for d in (4, 3, 2, 1) if steps % d == 0)


def launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, group: int, block_n: int, block_k: int, num_warps: int,
           k_splits: int, row_programs: bool = False) -> None:
    """`out = x @ dequant (+ bias)` for `x [M <= 8, K]`, K a whole number of groups; `k_splits` ranges at most,
    each of whole groups (validated by `awq_gemm.awq_linear`). With `row_programs` each row runs the one-row
    kernel in programs of its own, next to the other rows' programs of the same tile and range in launch order, so
    that a word tile read from HBM for one row is read from L2 for the others."""
    m, n = x.shape[0], out.shape[1]
    groups = scales.shape[0]
    per, splits = split_k.steps_per_split(groups, k_splits)
    tiles = triton.cdiv(n, block_n)
    rows = m if row_programs else 1
    p = split_k.partials(splits, m, n, out, tiles * rows, fixup=True)
    grid = (m, tiles, splits) if row_programs else (tiles, splits)
    _awq_gemv_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, p.workspace, p.counter_arg, m, n,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0), m * n, groups, per,
        MAGIC, GROUP=group, HAS_BIAS=bias is not None, PARTIAL=p.partial, FIXUP=p.fixup,
        BLOCK_M=1 if row_programs else triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        UNROLL=unroll(1 if row_programs else m, group // block_k), ROW_PROGRAMS=row_programs,
        PRELOAD=preloads(m, row_programs, block_k, block_n, num_warps), num_warps=num_warps,
        num_stages=1, **pdl_launch(x.device), **MAXNREG,
    )
    split_k.finish(p, bias, out)
