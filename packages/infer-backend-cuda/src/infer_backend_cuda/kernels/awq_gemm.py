"""W4A16 GEMMs for AutoAWQ "gemm" weights, dequantizing in registers: `out = x @ ((q - z) * s) (+ bias)`.

`qweight` int32 `[K, N/8]`, `qzeros` int32 `[K/group, N/8]`, `scales` fp16 `[K/group, N]`; column c of a group of
eight sits in nibble `[0, 4, 1, 5, 2, 6, 3, 7][c]` of its word, i.e. at bit `4 * ((c % 2) * 4 + c // 2)`. Each K
step stays inside one group (`BLOCK_K` divides the group), so a tile reads one row of zero points and scales.

Two kernels, picked by the config's `block_m`: up to SKINNY_MAX_M rows (decode) the CUDA-core GEMV of
`awq_gemv.py` (wide column blocks, zero point and scale out of the inner loop); above, the tiled kernel here:
each program streams a `[BLOCK_K, BLOCK_N / 8]` tile of packed words per K step, reading each word once,
unpacks it in registers and multiplies on the tensor cores (`tl.dot`). Both may split K into ranges (so that a
decode GEMM launches a few programs per SM); the last program of each tile (or, with `INFER_CUDA_SPLIT_K_FIXUP=0`,
a second small kernel) sums the ranges in a fixed order (split_k.py: the AWQ kernels' own choice). The tiled
kernel rounds dequantized weights to the activation dtype before the product, as the CPU reference's dequantized
GEMM does. Launch configs: a shape heuristic
(`scripts/bench_quant_gemm.py` times alternatives on a GPU).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import awq_gemv, split_k, tuned_table
from infer_backend_cuda.kernels._awq_nibbles import MAGIC, column_block, gated_column_block, unpack
from infer_backend_cuda.kernels._common import check_last_dim_contiguous, dot_in_fp32, next_pow2, pdl_launch
from infer_backend_cuda.kernels.activation import silu_and_mul
from infer_backend_cuda.kernels.skinny_gemm import GATED

SKINNY_MAX_M = 8
# Row tiles up to this take SCALE_AFTER (`_awq_kernel`): the step's product scaled once, BLOCK_M / BLOCK_K FMAs a
# weight (1/4 at 16 x 64), against the FMUL a weight it saves; prefill tiles of 64-128 rows keep the scaled weight.
SCALE_AFTER_MAX_M = 32


class AwqConfig(NamedTuple):
    """`block_m` <= SKINNY_MAX_M: the GEMV (its row block is next_pow2(M); `num_stages` unused, `k_splits` counts
    ranges of whole groups); above: the tiled kernel's row tile (`k_splits`: ranges of whole `block_k` steps)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    k_splits: int = 1  # K is cut into this many ranges (at most), summed in a fixed order (split_k.py)
    row_programs: bool = False  # the GEMV: each row in one-row programs of its own (`awq_gemv.launch`)



@triton.jit
def _awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, x_stride, qw_stride, qz_stride, s_stride, out_stride, split_stride, magic,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, K_SPLIT: tl.constexpr, PARTIAL: tl.constexpr, FIXUP: tl.constexpr,
    DOT_F32: tl.constexpr, SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (m, n, s) covers rows `m * BLOCK_M`, columns `n * BLOCK_N` and K `[s * K_SPLIT, (s + 1) * K_SPLIT)`;
    with PARTIAL it writes fp32 partial sums to `ws_ptr + s * split_stride` (a split-K workspace, split_k.py), which
    with FIXUP the last program of tile (m, n) sums into `out_ptr`. GATED: the weight is `[gate | up]`, a program's
    columns are gate columns and their up twins (`gated_column_block`), and the last program of each tile writes
    `silu(gate) * up` to `out [M, N / 2]` (`split_k.store_gated_tile`, always through the workspace).

    Each K step loads the packed words `[BLOCK_K, BLOCK_N / 8]` once (contiguous rows) and unpacks them in
    registers (`_awq_nibbles.unpack`; `magic` at run time, as in the GEMV, or ptxas re-materializes the nibble
    masks before every LOP3: sm_90 SASS 10.0 against ~7 instructions a weight at 16 x 128 x 64).

    SCALE_AFTER (decode tiles: few rows, so a product row costs less than a weight row) multiplies the exact
    integers `q - z` (one FFMA a weight from the unpacked field, exact in any activation dtype: |q - z| <= 15)
    and scales the step's `[BLOCK_M, BLOCK_N]` product by the group's scales afterwards, instead of an FADD and
    an FMUL a weight: the GEMV's numerics (the exact dequantized weight), not the reference's rounding of it.
    Its product is taken as `(w^T x^T)^T`, the weight tile the left operand: with x on the left, ptxas rebuilt the
    replicated x fragments with ~6 register moves per mma (sm_90 SASS of the loop: 8.6 against 7.0 instructions
    a weight at 16 x 128 x 64 on 4 warps; 6.5 against 5.0 at 16 x 256 x 128 on 8 warps, there on wgmma)."""
    if USE_PDL:  # programmatic dependent launch: start early, read x only after its producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm, rk = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
    if GATED:
        rw, cols, w_mask, n_mask, unscale = gated_column_block(pid_n, N, BLOCK_N)
    else:
        rw, cols, w_mask, n_mask, unscale = column_block(pid_n, N, BLOCK_N)
    m_mask = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * K_SPLIT
    # The last range stops at K: past it the group index would read scale and zero rows that do not exist (seen
    # on the H200: NaN partials, then an illegal address), which the masked activations cannot cancel (0 * NaN).
    k_end = tl.minimum(k_first + K_SPLIT, K)
    w_ptrs = qw_ptr + (k_first + rk)[:, None] * qw_stride + rw[None, :]
    # The words are loaded one step ahead by hand, so the next tile is in flight while this one is unpacked.
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
        s = tl.load(s_ptr + g * s_stride + cols, mask=n_mask, other=0.0).to(tl.float32)
        if SCALE_AFTER:
            # (2^23 + q 16^e) 16^-e - (2^23 16^-e + z) = q - z, exact (powers of two only move exponents).
            zu = unpack(zeros[None, :], BLOCK_N, magic) * unscale[None, :]
            w = (unpack(words, BLOCK_N, magic) * unscale[None, :] - zu).to(x.dtype)
        else:
            # ((q - z) 16^e) (s 16^-e) = (q - z) s, exact in fp32 (a 5-bit integer times an fp16 scale; the powers
            # of two only move exponents), then rounded to x's dtype as the reference's dequantized GEMM does.
            w = ((unpack(words, BLOCK_N, magic) - unpack(zeros[None, :], BLOCK_N, magic))
                 * (s * unscale)[None, :]).to(x.dtype)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif SCALE_AFTER:  # the weight tile as the left operand: out^T = w^T x^T
            part = tl.trans(tl.dot(tl.trans(w), tl.trans(x)))
        else:
            part = tl.dot(x, w)
        if SCALE_AFTER:
            acc += part * s[None, :]
        else:
            acc += part
    tile = pid_m * tl.num_programs(1) + pid_n
    if GATED:
        split_k.store_gated_tile(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask,
                                 pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), N, out_stride, split_stride,
                                 pid_k, tl.num_programs(2), tile, HAS_BIAS, BLOCK_M, BLOCK_N // 2)
    else:
        split_k.store_tile(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask, N, out_stride,
                           split_stride, pid_k, tl.num_programs(2), tile, PARTIAL, HAS_BIAS, FIXUP)


def group_block_k(group: int, cap: int) -> int:
    """The largest power of two <= cap dividing `group`: a K step that never straddles two groups."""
    block = 1
    while block * 2 <= cap and group % (block * 2) == 0:
        block *= 2
    return block


def check_group(group: int) -> None:
    if group_block_k(group, 16) < 16:
        raise ValueError(f"the cuda AWQ kernels need a group size divisible by 16, got {group}")


# The default GEMV's rows; above, the tiled kernel (see `default_config`). The eighth session's H200 replays (Qwen3-4B
# AWQ, docs/benchmarks.md) put two rows in row programs (3.489 ms, against 5.171 in the 2-row GEMV) and the tiled
# kernel from 3 (5.2 ms at 4-8 rows); since the decode tiles multiply the integers q - z with the weight tile on the
# left (SCALE_AFTER) and take their tuned configs (`_TABLE`), the tiled kernel wins from 2 rows: eleventh session, qkv /
# o_proj / gate_up / down at 2 rows 10.7 / 8.2 / 24.8 / 16.8 us against 17.8 / 11.9 / 28.2 / 18.4 as row programs.
# INFER_CUDA_AWQ_GEMV_MAX_M sets it for A/B runs (with INFER_CUDA_AWQ_ROW_PROGRAMS for the 2-8 row forms).
GEMV_MAX_M_ENV = "INFER_CUDA_AWQ_GEMV_MAX_M"
GEMV_MAX_M = int(os.environ.get(GEMV_MAX_M_ENV, "1"))
# Up to this many rows the GEMV takes 128-column blocks on 2 warps (`gemv_config`); INFER_CUDA_AWQ_NARROW_ROWS
# sets it for A/B runs (read once at import, like the other INFER_CUDA_ switches).
NARROW_ENV = "INFER_CUDA_AWQ_NARROW_ROWS"
NARROW_ROWS = int(os.environ.get(NARROW_ENV, "1"))
# Up to this many rows (at most SKINNY_MAX_M) each row runs the one-row GEMV in programs of its own, the word tiles
# shared through L2 (`awq_gemv.launch`); off by default (the decode tiles beat it at 2 rows, above). 0 keeps the
# multi-row GEMV up to GEMV_MAX_M (A/B runs).
ROW_PROGRAMS_ENV = "INFER_CUDA_AWQ_ROW_PROGRAMS"
ROW_PROGRAMS_ROWS = min(SKINNY_MAX_M, int(os.environ.get(ROW_PROGRAMS_ENV, "0")))
# Measured best configs per GPU (`scripts/bench_quant_gemm.py --table`): row bucket (`table_rows`), N, K and group.
_TABLE = tuned_table.CONFIGS / "awq_gemm.json"
table_key = tuned_table.rows_shape_group  # an entry's (row bucket, N, K, group)
DECODE_TILE_M = 16  # the decode tiles' row block: 2 to 16 rows share one tuned config
TABLE_MAX_M = 128
# The GEMV's (K step, widest column block) per row block: with 4 steps unrolled (`awq_gemv.unroll`) the
# products held per thread (`BLOCK_M * BLOCK_K * BLOCK_N / threads`, twice: the group's and the running sum)
# fit without spills (sm_90 SASS, `scripts/sass_census.py`: ~250 registers at 2 to 8 rows).
_GEMV_BLOCKS = {1: (8, 512), 2: (8, 512), 4: (4, 512), 8: (4, 256)}


def gemv_config(m: int, n: int, k: int, group: int) -> AwqConfig:
    """The GEMV's config for `m <= SKINNY_MAX_M` rows: K split to ~512 programs of its widest column block (512:
    two 128-byte lines per K row) while that leaves >= 3 programs per SM of 132, else of 256, the workspace
    within half the weight bytes. At one row the columns then go in blocks of 128 on 2 warps, 2-4x the
    programs, each holding a quarter of the registers: on the H200 (`bench_quant_gemm.py`, Qwen3-4B shapes, the
    split reduce included) qkv 12.25 -> 9.89 us, gate_up 26.68 -> 18.30, down 17.10 -> 14.91 (o_proj's best,
    11.36 against 13.56, was 256 columns of 16-row steps on 4 warps); the wider blocks were tuned when the
    programs' registers held 4 unrolled steps, not a whole group as now at one row (`awq_gemv.unroll`)."""
    bm, groups = next_pow2(m), k // group
    if 1 < m <= ROW_PROGRAMS_ROWS:
        one = gemv_config(1, n, k, group)
        return one._replace(block_m=bm, row_programs=True)
    block_k, widest = _GEMV_BLOCKS[bm]
    block_n = widest if triton.cdiv(n, widest) * groups >= 396 else 256
    splits = min(split_k.num_splits(groups, triton.cdiv(n, block_n)), max(1, k // (32 * m)))
    if m <= NARROW_ROWS:
        return AwqConfig(bm, 128, group_block_k(group, block_k), 2, 1, splits)
    return AwqConfig(bm, block_n, group_block_k(group, block_k), 4, 1, splits)


def default_config(m: int, n: int, k: int, group: int) -> AwqConfig:
    """Up to GEMV_MAX_M rows the GEMV (`awq_gemv.py`; 2 rows as row programs). sm_90 SASS per weight
    (`scripts/sass_census.py`): the one-row GEMV ~4, the multi-row one ~6.2 at 2, ~9.9 at 4 (its 3-D product
    converts x through shared memory), ~24 at 8; a padded 16-row `tl.dot` tile ~9.5 at any M <= 16, so from 3 rows
    the tensor cores (up to 64 or 128-row tiles for prefill; the H200's replays, at GEMV_MAX_M). K is split to fill
    the GPU, but only while the fp32 workspace traffic (`16 * M * splits / K` of the int4 weight's bytes; it stays
    in L2) is within a half (GEMV) or the weight's bytes (tiled). The tiled kernel dequantizes on the CUDA cores
    (~9.5 instructions a weight), so it is bound by how many SMs run it: held to a quarter, 32 rows split qkv /
    o_proj / down not at all / 2x / 4x, 48 / 40 / 80 programs for 132 SMs (the H200's batch-32 replay 14.1 ms
    against a 0.94 ms byte floor); the workspace, a few MB read back once from L2, costs less than the idle SMs."""
    if m <= max(GEMV_MAX_M, ROW_PROGRAMS_ROWS):
        return gemv_config(m, n, k, group)
    if m <= DECODE_TILE_M:  # untuned decode shapes: the H200's best at two of Qwen3-4B's four (o_proj, gate_up)
        bm, warps, block_n, block_k = DECODE_TILE_M, 4, 64, group_block_k(group, 128)
    elif m <= 64:
        bm, warps, block_n, block_k = next_pow2(m), 4, 128, group_block_k(group, 64)
    else:
        bm, warps, block_n, block_k = 128, 8, 128, group_block_k(group, 64)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    splits = min(split_k.num_splits(k // block_k, tiles), max(1, k // (16 * m)))
    return AwqConfig(bm, block_n, block_k, warps, 3, splits)


def table_rows(m: int) -> int:
    """The tuned table's row bucket: one row, the decode tiles' 2 to DECODE_TILE_M rows, then powers of two up to
    TABLE_MAX_M (decode batches under load; 0: not tuned)."""
    if m == 1:
        return 1
    if m <= DECODE_TILE_M:
        return DECODE_TILE_M
    return next_pow2(m) if m <= TABLE_MAX_M else 0


@lru_cache(maxsize=None)
def _tuned_table(device_name: str) -> dict[tuple[int, int, int, int], AwqConfig]:
    return {table_key(e): AwqConfig(*e["config"]) for e in tuned_table.entries(_TABLE, device_name)}


def choose_config(m: int, n: int, k: int, group: int, device: torch.device) -> AwqConfig:
    """This GPU's measured best for the shape's row bucket (`_TABLE`), else `default_config`; 2 to 16 rows only
    where the tiled kernel serves them (above GEMV_MAX_M, so that the A/B switch holds)."""
    rows = table_rows(m)
    if device.type == "cuda" and rows and (m == 1 or m > GEMV_MAX_M):
        cfg = _tuned_table(torch.cuda.get_device_name(device)).get((rows, n, k, group))
        if cfg is not None:
            return cfg
    return default_config(m, n, k, group)


def _operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    """(M, N, K, group) of a checked AWQ GEMM's operands; ValueError where they do not fit together or the kernels."""
    if x.dim() != 2 or qweight.shape[0] != x.shape[1] or scales.shape[1] != qweight.shape[1] * 8:
        raise ValueError(f"AWQ GEMM: input {tuple(x.shape)}, qweight {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} do not match")
    m, k = x.shape
    n = scales.shape[1]
    group = k // scales.shape[0]
    if group * scales.shape[0] != k:
        raise ValueError(f"AWQ GEMM: K = {k} is not a whole number of groups ({scales.shape[0]} scale rows)")
    check_group(group)
    check_last_dim_contiguous("input", x)
    return m, n, k, group


def _checked_config(cfg: AwqConfig, m: int, group: int) -> AwqConfig:
    if group % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide the group size {group}")
    if cfg.block_n % 8:
        raise ValueError(f"block_n {cfg.block_n} must be a multiple of 8 (whole packed words)")
    if cfg.block_m <= SKINNY_MAX_M and cfg.block_m < m:
        raise ValueError(f"a GEMV config covers at most block_m = {cfg.block_m} rows, got {m}")
    return cfg


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
    picks the kernel: <= SKINNY_MAX_M rows the CUDA-core GEMV, >= 16 the tensor cores (`tl.dot`)."""
    m, n, k, group = _operands(x, qweight, scales)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = _checked_config(config or choose_config(m, n, k, group, x.device), m, group)
    _launch(x, qweight, qzeros, scales, bias, out, cfg, group, gated=False)
    return out


def awq_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: AwqConfig | None = None,
) -> torch.Tensor:
    """`silu_and_mul(awq_linear(x, [gate | up] ...))` -> `[M, N / 2]`, with the plain GEMM's config at this shape: on
    the tiled kernel one launch, whose last program of each tile writes the activation (`split_k.store_gated_tile`);
    the GEMM and the SiLU-and-mul kernel on the GEMV (measured slower gated: below), where the halves do not pair in
    whole words (`gated_fits`), the split-K counters are off or short, or with `INFER_CUDA_GATED_GEMM=0`."""
    m, n, k, group = _operands(x, qweight, scales)
    cfg = _checked_config(config or choose_config(m, n, k, group, x.device), m, group)
    if GATED and cfg.block_m > SKINNY_MAX_M and gated_fits(n, cfg.block_n):
        act = _launch(x, qweight, qzeros, scales, bias, None, cfg, group, gated=True)
        if act is not None:
            return act
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, qweight, qzeros, scales, bias, out, cfg, group, gated=False)
    return silu_and_mul(out)


# The gated form on the one-row GEMV (thirty-fourth session, H100, Qwen3-4B AWQ replays): 2.281 / 2.281 ms against
# 2.231 / 2.235 unfused at one row (its programs read gate and up columns as two 32-byte runs a K row instead of one of
# 64), while the tiled kernel's at four rows gained (3.676 / 3.700 against 3.852 / 3.786): the tiled kernel alone.
def gated_fits(n: int, block_n: int) -> bool:
    """Whether a gated launch can pair `[gate | up]`'s columns in whole packed words: each half and each program's
    share of it (`block_n / 2`) a multiple of 8 columns."""
    return n % 16 == 0 and block_n % 16 == 0


def _launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor | None, cfg: AwqConfig, group: int,
            gated: bool) -> torch.Tensor | None:
    """Either kernel on checked operands, into `out` (`[M, N / 2]` made here when None and `gated`); its output.
    `gated` (the tiled kernel only): None, with nothing launched or allocated, where the split-K counters that launch
    needs are not available (`split_k.gated_partials`)."""
    if cfg.block_m <= SKINNY_MAX_M:
        awq_gemv.launch(x, qweight, qzeros, scales, bias, out, group, cfg.block_n, cfg.block_k, cfg.num_warps,
                        cfg.k_splits, cfg.row_programs)
        return out
    m, k = x.shape
    n = scales.shape[1]
    steps, splits = split_k.steps_per_split(triton.cdiv(k, cfg.block_k), cfg.k_splits)
    column_tiles = triton.cdiv(n // 2, cfg.block_n // 2) if gated else triton.cdiv(n, cfg.block_n)
    grid = (triton.cdiv(m, cfg.block_m), column_tiles, splits)
    if gated:
        p = split_k.gated_partials(splits, m, n, x.device, grid[0] * grid[1])
        if p is None:
            return None
        if out is None:
            out = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    else:
        p = split_k.partials(splits, m, n, out, grid[0] * grid[1], fixup=True)
    _awq_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, p.workspace, p.counter_arg, m, n, k,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0), m * n, MAGIC,
        GROUP=group, HAS_BIAS=bias is not None, K_SPLIT=steps * cfg.block_k, PARTIAL=p.partial, FIXUP=p.fixup,
        DOT_F32=dot_in_fp32(x.dtype), SCALE_AFTER=cfg.block_m <= SCALE_AFTER_MAX_M, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    if not gated:
        split_k.finish(p, bias, out)
    return out
