"""Triton helpers for grids flattened over a ragged batch's blocks of tokens."""

from __future__ import annotations

import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2

# Kernels whose launches see a step's batch size as an argument: Triton compiles a variant per value class
# (1, multiple of 16, other) of an integer argument unless told not to.
STEP_SIZE_ARGS = ("n_seq",)


def ragged_block_b(n_seq: int) -> int:
    """`BLOCK_B` of `batch_block` for a batch of `n_seq` sequences: one compiled variant for every batch of up to
    64 sequences, one per power of two above. A hybrid model's mixed steps run eager, so a variant per batch size
    would compile (seconds) in the middle of serving, stalling every request."""
    return max(64, next_pow2(n_seq))


def ragged_variant_batch_sizes(max_seqs: int) -> list[int]:
    """The smallest batch of each `ragged_block_b` variant past the first, up to `max_seqs` sequences."""
    sizes, n = [], ragged_block_b(1) + 1
    while n <= max_seqs:
        sizes.append(n)
        n = ragged_block_b(n) + 1
    return sizes


def grid_tiles(rows: int, block_m: int, n_seq: int, skip_single_token: bool, max_chunk_seqs: int | None) -> int:
    """How many query tiles of `block_m` rows the grid holds a KV head (an upper bound: the surplus programs
    return at once). Every sequence's tiles but its last are full, so a batch of `rows` (token, query head) rows
    has at most `cdiv(rows, block_m)` + (its sequences with a tile) of them: with `skip_single_token` only those of
    two tokens or more have one, of which there are at most `max_chunk_seqs` when the caller knows."""
    with_tiles = n_seq if not skip_single_token or max_chunk_seqs is None else min(n_seq, max_chunk_seqs)
    return triton.cdiv(rows, block_m) + with_tiles


@triton.jit
def batch_block(cu_ptr, n_seq, pid, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
                SKIP_SINGLE: tl.constexpr = False):
    """(sequence, block within it) of the batch's `pid`-th block of `BLOCK` rows, each token `ROWS_PER_TOKEN`
    rows (prefill attention packs a KV head's query heads), from a prefix sum of the sequences' block counts over
    `cu_ptr` (`[n_seq + 1]`), in registers. A grid of `cdiv(T * ROWS_PER_TOKEN, BLOCK) + n_seq` programs covers
    every block (all of a sequence's blocks but its last are full); programs past the last get `n_seq` as their
    sequence. With SKIP_SINGLE one-token sequences have no block (a mixed step's decode rows), so
    `cdiv(T * ROWS_PER_TOKEN, BLOCK) + (sequences of two tokens or more)` programs cover the others."""
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < n_seq
    lens = tl.load(cu_ptr + offs_b + 1, mask=b_mask, other=0) - tl.load(cu_ptr + offs_b, mask=b_mask, other=0)
    blocks = (lens * ROWS_PER_TOKEN + BLOCK - 1) // BLOCK
    if SKIP_SINGLE:
        blocks = tl.where(lens == 1, 0, blocks)
    ends = tl.cumsum(blocks, axis=0)  # inclusive: sequence i's blocks are [ends[i] - blocks[i], ends[i])
    seq = tl.sum((ends <= pid).to(tl.int32), axis=0)
    return seq, pid - tl.sum(tl.where(offs_b == seq, ends - blocks, 0), axis=0)
