"""Unpacking AutoAWQ's packed int4 words in registers, shared by the AWQ GEMM (`awq_gemm.py`) and GEMV
(`awq_gemv.py`): column c of a group of eight sits in nibble `[0, 4, 1, 5, 2, 6, 3, 7][c]` of its int32 word."""

from __future__ import annotations

import triton
import triton.language as tl

# The bits of 2^23 (`_field`). Kernels take it as a run-time argument: as a literal, ptxas keeps it as the LOP3's
# immediate and re-materializes the nibble masks before every LOP3 (sm_90 SASS, `scripts/sass_census.py`).
MAGIC = 0x4B000000


@triton.jit
def _field(words, i: tl.constexpr, magic):
    """Nibble `i` of each word as the fp32 `2^23 + code * 16^e` (`e = i`, or `i - 3` from nibble 5): masked in
    place (no shift: the nibble sits in the mantissa of 2^23, an exact int -> float conversion without the slow
    cvt) for the five low nibbles; the three high ones after one shared shift by 12 bits. The power of 16
    cancels against the column's scale (`column_unscale`), exactly."""
    if i >= 5:
        words = words >> 12
        e: tl.constexpr = i - 3
    else:
        e: tl.constexpr = i
    return ((words & (0xF << (4 * e))) | magic).to(tl.float32, bitcast=True)


@triton.jit
def unpack(words, BLOCK_N: tl.constexpr, magic):
    """int32 words `[R, BLOCK_N / 8]` -> fp32 `[R, BLOCK_N]` of `_field`s in column order. Column `c` of a word is
    nibble `4 (c % 2) + c // 2`; joined as a tree (each join adds a minor dimension, held in registers) the eight
    fields of a word land in one thread's registers in column order, so that the reshape and the loads and
    stores of whole column runs need no data movement."""
    lo = tl.join(tl.join(_field(words, 0, magic), _field(words, 2, magic)), tl.join(_field(words, 1, magic), _field(words, 3, magic)))
    hi = tl.join(tl.join(_field(words, 4, magic), _field(words, 6, magic)), tl.join(_field(words, 5, magic), _field(words, 7, magic)))
    return tl.reshape(tl.join(lo, hi), [words.shape[0], BLOCK_N])


@triton.jit
def column_unscale(cols):
    """`16^-e` of each column's field (see `_field`): column c holds nibble `4 (c % 2) + c // 2` of its word."""
    nibble = (cols % 2) * 4 + (cols % 8) // 2
    return tl.exp2(-4.0 * tl.where(nibble >= 5, nibble - 3, nibble).to(tl.float32))


@triton.jit
def column_block(pid_n, N, BLOCK_N: tl.constexpr):
    """Program `pid_n`'s columns of a packed weight: (its words, its columns, their masks, their `column_unscale`)."""
    BLOCK_W: tl.constexpr = BLOCK_N // 8
    rw = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rw, cols, rw < N // 8, cols < N, column_unscale(cols)


@triton.jit
def gated_column_block(pid_n, N, BLOCK_N: tl.constexpr):
    """`column_block` of a gated weight `[gate | up]` (N columns, N / 2 a multiple of 8): program `pid_n` takes gate
    columns `pid_n * BLOCK_N / 2 + j` and their up twins `+ N / 2`, the gate words first, so that one program's
    sums hold both halves of its output columns (`split_k.store_gated_tile`)."""
    HALF_W: tl.constexpr = BLOCK_N // 16
    HALF_N: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, 2 * HALF_W)
    gate_words = pid_n * HALF_W + j % HALF_W
    rw = gate_words + tl.where(j >= HALF_W, N // 16, 0)
    c = tl.arange(0, BLOCK_N)
    gate_cols = pid_n * HALF_N + c % HALF_N
    cols = gate_cols + tl.where(c >= HALF_N, N // 2, 0)
    return rw, cols, gate_words < N // 16, gate_cols < N // 2, column_unscale(cols)
