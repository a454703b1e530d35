"""Skinny GEMM (`M <= 8` rows): `out = x @ weight.T (+ bias)`, streaming the weight from HBM once.

At decode batch sizes a linear layer is a weight stream: `N·K·s` bytes against `2·M·N·K` FLOPs, so the
kernel is judged by bandwidth alone. cuBLAS reaches ~70-75 % of the copy bandwidth on Qwen3-4B's per-layer
shapes at M = 1 (docs/kernels.md). Each program here takes `BLOCK_N` whole weight rows and walks K in `BLOCK_K`
chunks, with no split-K (deterministic, one launch). Two tile forms: fp32 products kept in registers with one
reduction at the end (best at one row: many programs of 2-4 rows keep every SM streaming to the end of the
grid), or the transposed product `W·Xᵀ` on the tensor cores with the rows padded to 16 (as cheap at 8 rows as
at one). A variant fuses the residual add + RMSNorm into the prologue, another a gated MLP's SiLU-and-mul into the
epilogue (`skinny_linear_silu_mul`); an option prefetches each weight tile one iteration ahead, the first one before
waiting on the producer kernel (under PDL), and a switch asks for only the first one before the wait.

Launch configurations are chosen per (op, M bucket, N, K) from a table measured on the GPU
(`configs/skinny_gemm.json`, written by `packages/infer-backend-cuda/scripts/bench_skinny_gemm.py`), with a shape
heuristic otherwise.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import tuned_table
from infer_backend_cuda.kernels._common import (
    check_last_dim_contiguous, dot_in_fp32, next_pow2, on_off_switch, pdl_launch,
)
from infer_backend_cuda.kernels.activation import silu_mul

MAX_M = 8
# INFER_CUDA_GATED_GEMM=0: a gated MLP's gate / up GEMM without the SiLU-and-mul epilogue (that kernel after it; A/B
# runs; the AWQ tiled kernel's gated split-K sum follows it too, `awq_gemm.awq_linear_silu_mul`). On the H200 the
# epilogue with its gate / up rows paired adjacently gains 0.02-0.08 ms a decode step at 1-8 rows (docs/benchmarks.md,
# ninth session). Read once at import, like the other INFER_CUDA_ switches.
GATED_ENV = "INFER_CUDA_GATED_GEMM"
GATED = os.environ.get(GATED_ENV, "1").strip() != "0"
_TABLE = tuned_table.CONFIGS / "skinny_gemm.json"
# INFER_CUDA_SKINNY_ROW_BUCKETS="2:4": the rows of a tuned-table bucket take another bucket's entries (A/B runs;
# served on the H200 a two-row step took 2.97 ms where three and four rows, on the 4-row bucket, took 2.88-2.91:
# docs/benchmarks.md, seventeenth session). Read once at import, like the other INFER_CUDA_ switches.
ROW_BUCKETS_ENV = "INFER_CUDA_SKINNY_ROW_BUCKETS"


def parse_row_buckets(raw: str) -> dict[int, int]:
    """`"2:4"` or `"1:2,2:4"` -> {from bucket: to bucket}; buckets are 1, 2, 4 or 8."""
    remap: dict[int, int] = {}
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        try:
            src, dst = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"{ROW_BUCKETS_ENV}={raw!r}: expected FROM:TO row buckets, e.g. 2:4") from None
        if src not in (1, 2, 4, 8) or dst not in (1, 2, 4, 8):
            raise ValueError(f"{ROW_BUCKETS_ENV}={raw!r}: row buckets are 1, 2, 4 or 8")
        remap[src] = dst
    return remap


ROW_BUCKETS = parse_row_buckets(os.environ.get(ROW_BUCKETS_ENV, ""))
# INFER_CUDA_SKINNY_ROWWISE=0: configs marked `rowwise` run the 3D product instead of one 2D accumulator a row
# (`_skinny_gemm_kernel`'s ROWWISE; A/B runs). Read once at import, like the other INFER_CUDA_ switches.
ROWWISE_ENV = "INFER_CUDA_SKINNY_ROWWISE"
ROWWISE = os.environ.get(ROWWISE_ENV, "1").strip() != "0"
# INFER_CUDA_SKINNY_PRELOAD=1: configs without `prefetch` ask for their first weight tile before waiting on the
# producer (`_skinny_gemm_kernel`'s PRELOAD); off by default until a device A/B decides (the AWQ GEMV's preload
# took 7 % off its one-row step on the H100, thirty-third session; the prefetch form, which also carries a tile
# through the loop, lost in the model in the thirteenth).
PRELOAD_ENV = "INFER_CUDA_SKINNY_PRELOAD"


def preload_switch(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether configs without `prefetch` preload their first weight tile (PRELOAD_ENV; default off)."""
    return bool(on_off_switch(environ, PRELOAD_ENV, "first weight tile asked for before the wait", "after it"))


PRELOAD = preload_switch()


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = False  # tensor-core tiles (rows padded to 16) instead of CUDA-core products
    prefetch: bool = False  # load each weight tile one iteration ahead, the first before waiting for the producer
    rowwise: bool = False  # at 1-2 rows on CUDA cores: one 2D accumulator a row (`_skinny_gemm_kernel`'s ROWWISE)


PLAIN, ADD_RMS_NORM = 0, 1  # the kernel's prologue: what it makes of its input rows


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    r_out_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    r_stride,
    r_out_stride,
    w_stride,
    out_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVEN_N: tl.constexpr = False,
    ROWWISE: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
):
    """ROWWISE (a config's `rowwise`, CUDA-core products at 1-2 rows, where M == BLOCK_M): one `[BLOCK_N, BLOCK_K]`
    accumulator a row instead of the `[BLOCK_M, BLOCK_N, BLOCK_K]` product. The 3D product's weight operand is a
    slice of a layout that differs from the weight load's, so Triton moves every weight tile through shared memory
    (STS, barrier, LDSM); the 2D form keeps the loaded tile where it is (sm_90 SASS of the tiles that
    `rowwise_fits`: 3.1-4.7 against 4.2-5.8 instructions a weight at one row, 4.4-6.6 against 5.6-8.1 at two, no
    barrier). Fewer instructions are not always faster: on the H100 the form took 0.80-1.43x the 3D one's time,
    tile by tile (docs/benchmarks.md, thirty-sixth session), so the tables choose it per shape.

    EVEN_N: N is a multiple of the program's columns, so the weight loads need no row mask (and no zero-fill of the
    masked-off registers).

    With GATED the weight is `[gate | up]` (`N` rows, `N / 2` each) and the output `silu(gate) * up` `[M, N / 2]`:
    a program streams the gate and the up row of each of its `BLOCK_N / 2` output columns and applies the
    SiLU-and-mul in its epilogue (`gated_epilogue`).

    PRELOAD (without PREFETCH): the first K step is peeled off the loop and its weight tile asked for before
    `gdc_wait`, so that it streams in while the producer finishes; unlike PREFETCH no tile is carried through the
    loop, whose registers and instructions stay those of the plain form."""
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH and not PRELOAD:
            tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    if GATED:
        rn, n_mask = gated_weight_rows(pid, N, BLOCK_N, False)
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * w_stride + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # ROWWISE: row 0's products, row 1's, their squares
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq0 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sq1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if PREFETCH:
        # Weights are never written by a kernel, so the first tile may stream in while the producer of x is still
        # finishing (under PDL); each next tile is loaded one iteration ahead.
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
    else:
        w_next = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)  # unused
    # One program writes the new residual stream (PROLOGUE with a residual); the rest only read it.
    writer = (rk * 0 + pid) == 0
    PEELED: tl.constexpr = PRELOAD and not PREFETCH
    if PEELED:
        w = weight_tile(w_ptrs, rk, K, n_mask, EVEN_K, EVEN_N)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        acc, acc_t, sum_sq, acc0, acc1, sq0, sq1 = _skinny_step(
            acc, acc_t, sum_sq, acc0, acc1, sq0, sq1, w, rk, _k_mask(rk, rk, K, EVEN_K), writer, x_ptr, r_ptr,
            r_out_ptr, nw_ptr, x_stride, r_stride, r_out_stride, rm, m_mask, PROLOGUE, HAS_RESIDUAL, BLOCK_M, USE_DOT,
            DOT_F32, ROWWISE)
        w_ptrs += BLOCK_K
    for k0 in range(BLOCK_K if PEELED else 0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = _k_mask(rk, kk, K, EVEN_K)
        if PREFETCH:
            w = w_next
            # Whole tiles: the last step re-reads its own tile (an L2 hit) rather than masking the one past K; only in
            # the row-wise form, whose entries are new (the 3D form's keep the masked load they were measured with).
            if EVEN_K and EVEN_N and ROWWISE:
                w_next = tl.load(w_ptrs + tl.where(k0 + BLOCK_K < K, BLOCK_K, 0), eviction_policy="evict_first")
            else:
                w_next = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & ((kk + BLOCK_K) < K)[None, :], other=0.0,
                                 eviction_policy="evict_first")
        else:
            w = weight_tile(w_ptrs, kk, K, n_mask, EVEN_K, EVEN_N)
        acc, acc_t, sum_sq, acc0, acc1, sq0, sq1 = _skinny_step(
            acc, acc_t, sum_sq, acc0, acc1, sq0, sq1, w, kk, k_mask, writer, x_ptr, r_ptr, r_out_ptr, nw_ptr,
            x_stride, r_stride, r_out_stride, rm, m_mask, PROLOGUE, HAS_RESIDUAL, BLOCK_M, USE_DOT, DOT_F32, ROWWISE)
        w_ptrs += BLOCK_K
    if ROWWISE:
        y0 = tl.sum(acc0, axis=1)
        if PROLOGUE == 1:
            y0 = y0 * tl.rsqrt(tl.sum(sq0, axis=0) / K + eps)
        if BLOCK_M == 2:
            y1 = tl.sum(acc1, axis=1)
            if PROLOGUE == 1:
                y1 = y1 * tl.rsqrt(tl.sum(sq1, axis=0) / K + eps)
            y = tl.trans(tl.join(y0, y1))
        else:
            y = y0[None, :]
    else:
        if USE_DOT:
            y = tl.trans(acc_t)
        else:
            y = tl.sum(acc, axis=2)
        if PROLOGUE == 1:
            y = y * tl.rsqrt(sum_sq / K + eps)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gated_epilogue(y, out_ptr, out_stride, rm, m_mask, pid, N // 2, BLOCK_M, BLOCK_N)
    else:
        out_ptrs = out_ptr + rm[:, None] * out_stride + rn[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _k_mask(rk, kk, K, EVEN_K: tl.constexpr):
    """The K step's column mask (EVEN_K: all true, in a form the compiler folds)."""
    if EVEN_K:
        mask = rk < rk.shape[0]
    else:
        mask = kk < K
    return mask


@triton.jit
def weight_tile(w_ptrs, kk, K, n_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """A K step's `[BLOCK_N, BLOCK_K]` tile of whole weight rows at `w_ptrs` (columns `kk`, rows `n_mask`), streamed
    once (evict first), masked only where K or N has a partial tile (zeros there)."""
    if EVEN_K and EVEN_N:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    elif EVEN_K:
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _skinny_step(acc, acc_t, sum_sq, acc0, acc1, sq0, sq1, w, kk, k_mask, writer, x_ptr, r_ptr, r_out_ptr, nw_ptr,
                 x_stride, r_stride, r_out_stride, rm, m_mask, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ROWWISE: tl.constexpr):
    """One K step of `_skinny_gemm_kernel` on its weight tile `w` (columns `kk`): the accumulators of the form that
    runs (the 3D product's or the transposed dot's, and the norm's squares; or ROWWISE's per row) with its products."""
    if ROWWISE:
        wf = w.to(tl.float32)
        a, sq = _input_tile(x_ptr + kk, r_ptr + kk, r_out_ptr + kk, nw_ptr + kk, k_mask, k_mask, writer,
                            PROLOGUE, HAS_RESIDUAL)
        acc0 += wf * a[None, :]
        sq0 += sq
        if BLOCK_M == 2:
            a, sq = _input_tile(x_ptr + x_stride + kk, r_ptr + r_stride + kk, r_out_ptr + r_out_stride + kk,
                                nw_ptr + kk, k_mask, k_mask, writer, PROLOGUE, HAS_RESIDUAL)
            acc1 += wf * a[None, :]
            sq1 += sq
    else:
        a, sq = _input_tile(x_ptr + rm[:, None] * x_stride + kk[None, :],
                            r_ptr + rm[:, None] * r_stride + kk[None, :],
                            r_out_ptr + rm[:, None] * r_out_stride + kk[None, :], nw_ptr + kk[None, :],
                            m_mask[:, None] & k_mask[None, :], k_mask[None, :], writer[None, :], PROLOGUE,
                            HAS_RESIDUAL)
        if PROLOGUE == 1:
            sum_sq += tl.sum(sq, axis=1)
        if USE_DOT:  # out^T tile [BLOCK_N, BLOCK_M] on the tensor cores: N fills the MMA's M side
            if DOT_F32:
                acc_t += tl.dot(w.to(tl.float32), tl.trans(a), input_precision="ieee")
            else:
                acc_t += tl.dot(w, tl.trans(a.to(w.dtype)))
        else:
            acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc, acc_t, sum_sq, acc0, acc1, sq0, sq1


@triton.jit
def _input_tile(x_ptrs, r_ptrs, r_out_ptrs, nw_ptrs, mask, k_mask, writer, PROLOGUE: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr):
    """A tile of the GEMM's input rows in fp32 (one row `[BLOCK_K]` or rows `[BLOCK_M, BLOCK_K]`) and, for the
    RMSNorm prologue, its squares before the norm's weight: with PROLOGUE the residual is added (rounded to the
    stream's dtype, as unfused) and written where `writer`, and the tile scaled by the norm's weight."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(r_out_ptrs, x, mask=mask & writer)
        a = x.to(tl.float32)
        sq = a * a
        a = a * tl.load(nw_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    else:
        a = x.to(tl.float32)
        sq = a
    return a, sq


@triton.jit
def gated_weight_rows(pid, N, BLOCK_N: tl.constexpr, IN_BOUNDS: tl.constexpr):
    """The weight rows of a gated program (weight `[gate | up]`, `N` rows): gate row c, then up row c, for each of
    its `BLOCK_N / 2` output columns c, the pairs adjacent for `gated_epilogue` to split; and the mask of the real
    columns. IN_BOUNDS: a column past the last one wraps to the first ones (for unmasked loads; an integer modulo
    by N that kernels masking their loads leave out)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    col = pid * HALF_N + j // 2
    n_mask = col < N // 2
    if IN_BOUNDS:
        col = col % (N // 2)
    return tl.where(j % 2 == 0, col, N // 2 + col), n_mask


@triton.jit
def gated_epilogue(y, out_ptr, out_stride, rm, m_mask, pid, half_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`y [BLOCK_M, BLOCK_N]` = (gate, up) column pairs of output columns `pid * BLOCK_N / 2 + j`: stores
    `silu(gate) * up`, each GEMM output first rounded to the output dtype and the product rounded again, as the
    unfused GEMM and `silu_and_mul` round. (The pairs are adjacent so that the split needs no permute, which
    could change the layout the main loop's tiles are given.)"""
    HALF_N: tl.constexpr = BLOCK_N // 2
    dt = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(y, [BLOCK_M, HALF_N, 2]))
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    act = silu_mul(gate, up)
    cols = pid * HALF_N + tl.arange(0, HALF_N)
    mask = m_mask[:, None] & (cols < half_n)[None, :]
    tl.store(out_ptr + rm[:, None] * out_stride + cols[None, :], act.to(dt), mask=mask)


def m_bucket(m: int) -> int:
    """The row count a tuned config is keyed by: 1, 2, 4 or 8."""
    return next_pow2(m)


def block_m(m: int, use_dot: bool) -> int:
    """The padded row count a launch compiles for (`tl.dot` tiles need at least 16)."""
    return max(16, next_pow2(m)) if use_dot else next_pow2(m)


OPS = {"linear": PLAIN, "add_rms_norm_linear": ADD_RMS_NORM}


@lru_cache(maxsize=None)
def _tuned_table(device_name: str) -> dict[tuple[str, int, int, int], SkinnyConfig | None]:
    """(op, M bucket, N, K) -> the measured best config, or None where the unfused cuBLAS path measured faster."""
    return {
        table_key(e): (
            SkinnyConfig(e["block_n"], e["block_k"], e["num_warps"], e["num_stages"], e.get("use_dot", False),
                         e.get("prefetch", False), e.get("rowwise", False))
            if e["use"]
            else None
        )
        for e in tuned_table.entries(_TABLE, device_name)
    }


def table_key(entry: dict) -> tuple[str, int, int, int]:
    """(op, M bucket, N, K) of a table entry."""
    return entry.get("op", "linear"), entry["m"], entry["n"], entry["k"]


def rowwise_fits(cfg: SkinnyConfig, element_size: int) -> bool:
    """Whether a CUDA-core config's weight tile puts every thread along K (16-byte loads, 32 threads a warp), so
    that the row-wise accumulators' input row has the weight tile's layout: the tiles worth trying `rowwise`. Where
    warps or threads also split the tile's rows, the input row is replicated across them and Triton moves it through
    shared memory each K step, which can cost more than the 3D product (sm_90 SASS: up to 3-5x the instructions a
    weight)."""
    return not cfg.use_dot and cfg.block_k * element_size >= 16 * 32 * cfg.num_warps


def heuristic_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Untuned shapes: ~8 KB of weight per K step per program, fewer rows per program as M grows (the
    fp32 product tile is `M x BLOCK_N x BLOCK_K` registers)."""
    bm = m_bucket(m)
    block_k = min(next_pow2(k), 512 if bm <= 2 else 256)
    block_n = 8 if bm == 1 else 4
    return SkinnyConfig(block_n, block_k, 4, 2)


def choose_config(op: str, m: int, n: int, k: int, device: torch.device) -> SkinnyConfig | None:
    """The launch config of `op` at this shape, or None where cuBLAS (unfused) is the better path: where this
    GPU's table measured it so, and for untuned shapes above 2 rows (where the CUDA-core products cost more
    than the weight stream saves)."""
    if op not in OPS:
        raise ValueError(f"unknown skinny op {op!r}")
    key = (op, ROW_BUCKETS.get(m_bucket(m), m_bucket(m)), n, k)
    if device.type == "cuda":
        table = _tuned_table(torch.cuda.get_device_name(device))
        if key in table:
            return table[key]
    return heuristic_config(m, n, k) if m_bucket(m) <= 2 else None


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[int, int]:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"skinny GEMM: input {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the skinny GEMM takes 1..{MAX_M} rows, got {m}")
    check_last_dim_contiguous("input", x)
    check_last_dim_contiguous("weight", weight)
    return m, weight.shape[0]


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    config: SkinnyConfig | None,
    k: int,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> torch.Tensor:
    m, n = _check(x, weight, k)
    n_out = n // 2 if gated else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    check_last_dim_contiguous("out", out)
    cfg = config or heuristic_config(m, n, k)
    if gated and cfg.block_n < 2:
        cfg = cfg._replace(block_n=2)
    r = residual if residual is not None else x
    r_out = residual_out if residual_out is not None else x
    rows = block_m(m, cfg.use_dot)
    _skinny_gemm_kernel[(triton.cdiv(n_out, cfg.block_n // 2) if gated else triton.cdiv(n, cfg.block_n),)](
        x,
        r,
        norm_weight if norm_weight is not None else weight,
        r_out,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        r.stride(0),
        r_out.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=rows,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        USE_DOT=cfg.use_dot,
        DOT_F32=dot_in_fp32(x.dtype),
        PREFETCH=cfg.prefetch,
        GATED=gated,
        EVEN_N=n_out % (cfg.block_n // 2 if gated else cfg.block_n) == 0,
        ROWWISE=ROWWISE and cfg.rowwise and not cfg.use_dot and rows == m <= 2,
        PRELOAD=PRELOAD and not cfg.prefetch,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`x [M, K] @ weight[N, K].T (+ bias [N])` -> `[M, N]` in x's dtype, for `1 <= M <= 8`."""
    return _launch(PLAIN, x, weight, bias, out, config, x.shape[-1])


def skinny_linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`silu_and_mul(x @ weight.T (+ bias))` for `weight = [gate | up]` `[2I, K]` -> `[M, I]`: the gate / up GEMM with
    the SiLU-and-mul in its epilogue (no `[M, 2I]` intermediate, no second launch). `config` is the plain GEMM's
    at this shape (a program's `block_n` weight rows are half gate, half up)."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gate / up weight has an even number of rows, got {weight.shape[0]}")
    return _launch(PLAIN, x, weight, bias, out, config, x.shape[-1], gated=True)


def skinny_add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + residual` (just `x` when residual is None); `(linear(rms_norm(h) * norm_weight), h)`.

    `residual_out` must not alias `residual` or `x`: one program writes it while the others still read them."""
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        check_last_dim_contiguous("residual", residual)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        elif residual_out.data_ptr() in (residual.data_ptr(), x.data_ptr()):
            raise ValueError("residual_out must not alias residual or x")
    y = _launch(ADD_RMS_NORM, x, weight, bias, out, config, x.shape[-1], residual, norm_weight, residual_out, eps)
    return y, (residual_out if residual is not None else x)
