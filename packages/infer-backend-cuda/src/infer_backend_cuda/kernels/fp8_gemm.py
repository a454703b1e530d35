"""Block FP8 (W8A8, DeepSeek / Qwen3-FP8): dynamic activation quantization and the block-scaled GEMMs.

`fp8_quantize_activation`: per row and per `group` columns, scale = amax / 448 (1 where amax is 0), codes =
e4m3(clamp(x / scale, ±448)), with IEEE division so that the codes equal the CPU reference's bit for bit.

`fp8_block_linear`: `y = sum_g (x_q[:, g] @ w_q[:, g].T) * x_scale[:, g] * w_scale[row, g]` in fp32, one K step per
group; `scale_row [N]` names the `weight_scale_inv` row of each output row (fused parts keep their own partial
blocks). Prefill and decode rows take a tiled `tl.dot` kernel (e4m3 x e4m3 on Hopper's tensor cores), split
over K at decode (split_k.py), after the quantization kernel. A GEMV-style kernel (CUDA-core products per group,
split-K) that quantizes the activations itself (the same numerics, one launch fewer) serves a tuned entry of
`block_m <= 8`; it was the one-row default until it measured slower than the tiles (`default_config`). A kernel
streaming whole weight rows like the BF16 skinny GEMM (`row_groups`) measured slower still at one row on the H200
and is not a default either; it issued 7.5-13 instructions a weight then (70-110 % of an H100's issue rate at its
copy rate), 3.3-3.7 since its one-row accumulator (thirty-sixth session, sm_90 SASS; not yet timed).
From 65 rows, where the weight's scale blocks are the whole 128x128 grid and the device passed a one-time check,
the GEMM goes to cuBLASLt's block-scaled recipe instead (`fp8_scaled_mm.py`: Hopper, torch >= 2.9); partial
blocks (SmolLM2, fused parts of odd sizes), other GPUs and CPU runs keep the Triton kernels.
A GPU's measured bests (`configs/fp8_gemm.json`, row buckets of powers of two up to 256; `choose_config`) take
precedence over both rules where the table has the shape.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import fp8_scaled_mm, split_k, tuned_table
from infer_backend_cuda.kernels import mid_gemm as mid
from infer_backend_cuda.kernels.activation import silu_and_mul
from infer_backend_cuda.kernels._common import (
    check_last_dim_contiguous, dot_in_fp32, interpreting, next_pow2, norm_num_warps, pdl_launch, rows_view,
)
from infer_backend_cuda.kernels.rms_norm import add_rms_norm, add_rms_norm_row, rms_norm
from infer_backend_cuda.kernels.skinny_gemm import weight_tile

_E4M3_MAX = tl.constexpr(448.0)  # kernels may read only constexpr globals
SKINNY_MAX_M = 8
SMS = 132  # an H100 / H200
MID_PROGRAMS = 2 * SMS  # programs a 65-1023-row launch aims for: two per SM hide each other's load latency
PREFILL_M = 1024
SCALED_MM_MIN_M = 65  # from here cuBLASLt's block-scaled GEMM (fp8_scaled_mm.py) where the device has it
# Measured best configs per GPU (`scripts/bench_quant_gemm.py --formats fp8 --table`): row bucket (`table_rows`),
# N, K and group; an entry may name cuBLASLt (`scaled_mm`).
_TABLE = tuned_table.CONFIGS / "fp8_gemm.json"
table_key = tuned_table.rows_shape_group  # an entry's (row bucket, N, K, group)
TABLE_MAX_M = 256


class Fp8Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_splits: int = 1  # K groups cut into this many ranges (at most); see split_k.py
    row_groups: int = 0  # > 0: the row-streaming kernel (`_fp8_rows_kernel`), this many K groups per step
    scaled_mm: bool = False  # cuBLASLt through torch._scaled_mm (fp8_scaled_mm.py); the other fields unused


@triton.jit
def _round_to_e4m3_grid(v):
    """`v` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32. Triton 3.9's interpreter casts
    fp32 to fp8 wrongly where rounding carries into the exponent (124.7 -> 64), so under it the cast is handed
    values it need not round; on the GPU the hardware conversion (cvt.rn.satfinite) rounds the same way."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = tl.exp2((tl.maximum(exponent, -6) - 3).to(tl.float32))  # 3 mantissa bits; subnormals below 2^-6
    t = v / quantum  # exact: a power of two
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 != 0), r - 1.0, r)
    return r * quantum


@triton.jit
def _quantize_groups(x, ROUND_IN_FP32: tl.constexpr):
    """fp32 `x [R, group]` (zeros where masked) -> (fp32 codes on the e4m3 grid, fp32 scales `[R]`), the
    reference's numerics: IEEE divisions, so that the codes equal the CPU's bit for bit."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32)), 1.0)
    codes = tl.clamp(tl.math.div_rn(x, tl.zeros_like(x) + scale[:, None]), -_E4M3_MAX, _E4M3_MAX)
    if ROUND_IN_FP32:
        codes = _round_to_e4m3_grid(codes)
    return codes, scale


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, x_stride, q_stride, s_row_stride, s_group_stride,
    GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Rows at or past M (padding of the cuBLAS path) quantize zeros: codes 0, scale 1."""
    if USE_PDL:  # programmatic dependent launch: start early, read x only after its producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row, g = tl.program_id(0), tl.program_id(1)
    cols = (g * GROUP + tl.arange(0, GROUP))[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + cols, mask=mask & (cols * 0 + row < M), other=0.0).to(tl.float32)
    codes, scale = _quantize_groups(x, ROUND_IN_FP32)
    tl.store(q_ptr + row.to(tl.int64) * q_stride + cols, codes.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_row_stride + g * s_group_stride + tl.arange(0, 1), scale)


@triton.jit
def _load_x_scale(xs_ptr, rm, m_mask, xs_stride, g, FUSE_QUANT: tl.constexpr):
    """The activation scales of group `g` (with FUSE_QUANT the kernel makes them itself: zeros here)."""
    if FUSE_QUANT:
        scale = tl.zeros(rm.shape, tl.float32)
    else:
        scale = tl.load(xs_ptr + rm * xs_stride + g, mask=m_mask, other=0.0)
    return scale


@triton.jit
def _load_w_scale(ws_ptr, scale_rows, n_mask, ws_stride, g, UNIFORM: tl.constexpr):
    """Group `g`'s weight scale: one for the tile (UNIFORM: `scale_rows` the tile's scale row) or one a column."""
    if UNIFORM:
        scale = tl.load(ws_ptr + scale_rows * ws_stride + g)
    else:
        scale = tl.load(ws_ptr + scale_rows * ws_stride + g, mask=n_mask, other=0.0)
    return scale


@triton.jit
def _fp8_gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, row_ptr, b_ptr, out_ptr, part_ptr, counter_ptr,
    M, N, K, xq_stride, xs_stride, w_stride, ws_stride, out_stride,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, SKINNY: tl.constexpr,
    GROUPS_PER_SPLIT: tl.constexpr, PARTIAL: tl.constexpr, FIXUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FUSE_QUANT: tl.constexpr, ROUND_IN_FP32: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (m, n, s) covers K groups `[s * GROUPS_PER_SPLIT, (s + 1) * GROUPS_PER_SPLIT)`; with PARTIAL it
    stores fp32 partial sums at `part_ptr + s * M * N` (a split-K workspace `[splits, M, N]`), which the reduce
    launch sums (the FP8 GEMMs' choice; with FIXUP the last program of tile (m, n) sums into `out_ptr`, split_k.py).

    With FUSE_QUANT `xq_ptr` is the unquantized input (`xs_ptr` unused): each program quantizes the activation
    groups of its own K range, one group per K step (a few rows: the work is small next to the weight tile, and
    it saves the quantization kernel's launch and its codes' round trip).

    W_SCALE_UNIFORM (every column of the tile in one weight-scale block: the regular 128-block grid and BLOCK_N
    dividing 128) loads one weight scale per group and folds it into the row scales, so the per-group promotion
    costs one FMA per accumulator element instead of a multiply for the scale outer product and an FMA; the
    products are the same fp32 values, so the result is bit for bit the general path's."""
    if USE_PDL:  # programmatic dependent launch: start early, read the activations only after their producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_mask, n_mask = rm < M, rn < N
    if W_SCALE_UNIFORM:
        scale_rows = tl.load(row_ptr + pid_n * BLOCK_N)  # the tile's one scale row
    else:
        scale_rows = tl.load(row_ptr + rn, mask=n_mask, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_first = pid_k * GROUPS_PER_SPLIT
    groups = tl.cdiv(K, GROUP)
    g_end = tl.minimum(g_first + GROUPS_PER_SPLIT, groups)
    # The scales are loaded one group ahead: Triton's pipeliner prefetches only the dot's operands, and a scale
    # loaded in the step that uses it put a global round trip into every K step (sm_90 TTGIR: plain loads after
    # the wgmma's wait). The last step re-reads the last group's scales instead of masking.
    x_scale_next = _load_x_scale(xs_ptr, rm, m_mask, xs_stride, g_first, FUSE_QUANT)
    w_scale_next = _load_w_scale(ws_ptr, scale_rows, n_mask, ws_stride, g_first, W_SCALE_UNIFORM)
    for g in range(g_first, g_end):
        x_scale, w_scale = x_scale_next, w_scale_next
        g_next = tl.minimum(g + 1, groups - 1)
        x_scale_next = _load_x_scale(xs_ptr, rm, m_mask, xs_stride, g_next, FUSE_QUANT)
        w_scale_next = _load_w_scale(ws_ptr, scale_rows, n_mask, ws_stride, g_next, W_SCALE_UNIFORM)
        kk = g * GROUP + rk
        k_mask = kk < K
        a = tl.load(xq_ptr + rm.to(tl.int64)[:, None] * xq_stride + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if FUSE_QUANT:
            codes, x_scale = _quantize_groups(a.to(tl.float32), ROUND_IN_FP32)
            a = codes.to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + rn.to(tl.int64)[None, :] * w_stride + kk[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [GROUP, BLOCK_N]
        if SKINNY:
            partial = tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        elif DOT_F32:
            partial = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            partial = tl.dot(a, w)
        if W_SCALE_UNIFORM:
            acc += partial * (x_scale * w_scale)[:, None]
        else:
            acc += partial * (x_scale[:, None] * w_scale[None, :])
    split_k.store_tile(acc, out_ptr, part_ptr, b_ptr, counter_ptr, rm, rn, m_mask, n_mask, N, out_stride, M * N,
                       pid_k, tl.num_programs(2), pid_m * tl.num_programs(1) + pid_n, PARTIAL, HAS_BIAS, FIXUP)


@triton.jit
def _fp8_rows_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, row_ptr, b_ptr, out_ptr,
    M, N, K, xq_stride, xs_stride, w_stride, ws_stride, out_stride,
    GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Decode as the BF16 skinny GEMM streams it: each program takes `BLOCK_N` whole weight rows in their
    natural layout (K contiguous, wide loads), several groups a K step, and accumulates every product, scaled
    by its two block scales, in a `[BLOCK_M, BLOCK_N, BLOCK_K]` tile reduced once at the end. The other kernel's
    per-group reduction across threads (shuffles every step) is what this avoids; scaling before the sum
    changes only the fp32 rounding order against the reference's `sum(q_x q_w) * s_x * s_w`. EVEN (whole
    tiles every way) drops the masks, which cost as many instructions as the products (predicated narrow
    loads; sm_90 SASS).

    One row (BLOCK_M == 1) keeps a `[BLOCK_N, BLOCK_K]` accumulator instead of the 3D tile, whose weight operand is a
    slice of a layout other than the weight load's, so that every weight tile crossed shared memory (the BF16 skinny
    GEMM's `rowwise`, docs/kernels.md). W_SCALE_UNIFORM (every row of the program in one scale block, `_uniform_tiles`):
    both block scales fold into the activation row, a `[GROUPS_PER_STEP]` product a step, so a weight costs its
    conversion and one FMA.

    Under PDL the program starts while x's producer (the quantization pass) finishes and asks for what no kernel
    writes before `gdc_wait`: its scale rows and its first weight tile, whose K step is peeled off the loop (a tile
    carried one step ahead through the loop instead cost 6-6.5 instructions a weight and spilled; sm_90 SASS)."""
    BLOCK_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    scale_rows = tl.load(row_ptr + rn, mask=n_mask, other=0)
    if W_SCALE_UNIFORM:
        first_scale_row = tl.load(row_ptr + pid * BLOCK_N)  # every row's
    else:
        first_scale_row = 0  # unused
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * w_stride + rk[None, :]
    w = weight_tile(w_ptrs, rk, K, n_mask, EVEN, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_row = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc, acc_row = _rows_step(acc, acc_row, w, 0, xq_ptr, xs_ptr, ws_ptr, K, xq_stride, xs_stride, ws_stride, rm,
                              rk, m_mask, n_mask, scale_rows, first_scale_row, GROUP, GROUPS_PER_STEP, BLOCK_M,
                              BLOCK_N, EVEN, W_SCALE_UNIFORM)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = weight_tile(w_ptrs + k0, k0 + rk, K, n_mask, EVEN, EVEN)
        acc, acc_row = _rows_step(acc, acc_row, w, k0, xq_ptr, xs_ptr, ws_ptr, K, xq_stride, xs_stride, ws_stride,
                                  rm, rk, m_mask, n_mask, scale_rows, first_scale_row, GROUP, GROUPS_PER_STEP,
                                  BLOCK_M, BLOCK_N, EVEN, W_SCALE_UNIFORM)
    if BLOCK_M == 1:
        y = tl.sum(acc_row, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _rows_step(acc, acc_row, w, k0, xq_ptr, xs_ptr, ws_ptr, K, xq_stride, xs_stride, ws_stride, rm, rk, m_mask,
               n_mask, scale_rows, first_scale_row, GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr):
    """One K step of `_fp8_rows_kernel` on its weight tile `w` (K offset `k0`): (acc, acc_row) with its products."""
    BLOCK_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    kk = k0 + rk
    k_mask = kk < K
    g = k0 // GROUP + tl.arange(0, GROUPS_PER_STEP)
    g_mask = g < tl.cdiv(K, GROUP)
    if BLOCK_M == 1:  # the row's codes and scales as vectors
        a_row = tl.load(xq_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        x_scale = tl.load(xs_ptr + g, mask=g_mask, other=0.0)
    if BLOCK_M == 1 and W_SCALE_UNIFORM:
        w_scale = tl.load(ws_ptr + first_scale_row * ws_stride + g, mask=g_mask, other=0.0)
        acc_row += w.to(tl.float32) * (a_row * _per_column(x_scale * w_scale, GROUPS_PER_STEP, GROUP))[None, :]
    else:
        if EVEN:
            w_scale = tl.load(ws_ptr + scale_rows[:, None] * ws_stride + g[None, :])
        else:
            w_scale = tl.load(ws_ptr + scale_rows[:, None] * ws_stride + g[None, :],
                              mask=n_mask[:, None] & g_mask[None, :], other=0.0)
        wf = w.to(tl.float32) * tl.reshape(
            tl.broadcast_to(w_scale[:, :, None], [BLOCK_N, GROUPS_PER_STEP, GROUP]), [BLOCK_N, BLOCK_K])
        if BLOCK_M == 1:
            acc_row += wf * (a_row * _per_column(x_scale, GROUPS_PER_STEP, GROUP))[None, :]
        else:
            if EVEN:
                a = tl.load(xq_ptr + rm[:, None] * xq_stride + kk[None, :])
                x_scale = tl.load(xs_ptr + rm[:, None] * xs_stride + g[None, :])
            else:
                a = tl.load(xq_ptr + rm[:, None] * xq_stride + kk[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                x_scale = tl.load(xs_ptr + rm[:, None] * xs_stride + g[None, :],
                                  mask=m_mask[:, None] & g_mask[None, :], other=0.0)
            a = a.to(tl.float32) * tl.reshape(
                tl.broadcast_to(x_scale[:, :, None], [BLOCK_M, GROUPS_PER_STEP, GROUP]), [BLOCK_M, BLOCK_K])
            acc += a[:, None, :] * wf[None, :, :]
    return acc, acc_row


@triton.jit
def _per_column(v, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """`v [GROUPS]` -> `[GROUPS * GROUP]`, each group's value repeated over its columns."""
    return tl.reshape(tl.broadcast_to(v[:, None], [GROUPS, GROUP]), [GROUPS * GROUP])


def _quant_outputs(x: torch.Tensor, group: int, codes: torch.Tensor | None, scales: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization's codes `[R, K]` and scales `[R, groups]` (fresh `[M, ...]` ones where not given), checked."""
    check_last_dim_contiguous("input", x)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    if codes is None:
        codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        scales = torch.empty((codes.shape[0], groups), dtype=torch.float32, device=x.device)
    if codes.shape[0] < m or scales.shape != (codes.shape[0], groups):
        raise ValueError(f"FP8 quantization: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} for input "
                         f"{tuple(x.shape)} in groups of {group}")
    return codes, scales


def fp8_quantize_activation(
    x: torch.Tensor, group: int, codes: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (e4m3 codes `[M, K]`, fp32 scales `[M, ceil(K / group)]`). Given `codes [R, K]` and `scales
    [R, groups]` (any strides; R >= M) rows M..R are filled as zero rows."""
    m, k = x.shape
    codes, scales = _quant_outputs(x, group, codes, scales)
    rows, groups = scales.shape
    if rows:
        _act_quant_kernel[(rows, groups)](
            x, codes, scales, m, k, x.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
            GROUP=group, ROUND_IN_FP32=interpreting(), num_warps=1 if group <= 128 else 2, **pdl_launch(x.device))
    return codes, scales


@triton.jit
def _norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, res_out_ptr, q_ptr, s_ptr, M, H, eps, x_stride, res_stride, res_out_stride, q_stride,
    s_row_stride, s_group_stride,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row: (residual add +) RMSNorm, rounded to x's dtype as the norm kernel stores it, then quantized in
    `GROUP`-column groups as `_act_quant_kernel` does; rows at or past M (padding) give codes 0 and scale 1."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    y = add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, M, x_stride, res_stride, res_out_stride, H,
                         eps, HAS_RESIDUAL, BLOCK, USE_PDL, True)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    codes, scale = _quantize_groups(tl.reshape(y, (BLOCK // GROUP, GROUP)), ROUND_IN_FP32)
    g = tl.arange(0, BLOCK // GROUP)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(q_ptr + row * q_stride + cols, codes.to(q_ptr.dtype.element_ty), mask=cols < H)
    tl.store(s_ptr + row * s_row_stride + g * s_group_stride, scale, mask=g * GROUP < H)


class NormPrologue(NamedTuple):
    """The (residual add +) RMSNorm before an FP8 GEMM, done by the pass that quantizes the GEMM's activations
    (`fp8_norm_quantize`): the norm's own launch and its output's round trip saved. `residual_out` receives the new
    residual (unused without a residual)."""

    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor | None

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's output itself, for a GEMM that quantizes its own activations."""
        if self.residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, self.residual, self.weight, self.eps, residual_out=self.residual_out)[0]

    def quantize(self, x: torch.Tensor, group: int, codes: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_norm_quantize(x, self, group, codes, scales)


def norm_quant_fits(hidden: int, group: int) -> bool:
    """Whether one program can quantize a normed row: power-of-two groups (whole or a partial last one)."""
    return group == next_pow2(group) and max(next_pow2(hidden), group) <= 16384


def fp8_norm_quantize(
    x: torch.Tensor, norm: NormPrologue, group: int, codes: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_quantize_activation(rms_norm(x (+ residual)), group, codes, scales)` in one launch, equal to the two
    kernels bit for bit; the new residual goes to `norm.residual_out`."""
    m, k = x.shape
    if not norm_quant_fits(k, group):
        raise ValueError(f"FP8 norm + quantization: groups of {group} over rows of {k}")
    codes, scales = _quant_outputs(x, group, codes, scales)
    rows = codes.shape[0]
    has_res = norm.residual is not None
    if has_res and norm.residual_out is None:
        raise ValueError("FP8 norm + quantization: a residual needs its residual_out")
    res = rows_view(norm.residual) if has_res else x
    res_out = norm.residual_out.view(-1, k) if has_res and norm.residual_out is not None else x
    if has_res and (res.shape != x.shape or res_out.shape != x.shape):
        raise ValueError(f"FP8 norm + quantization: residual {tuple(res.shape)} for input {tuple(x.shape)}")
    block = max(next_pow2(k), group)
    if rows:
        _norm_quant_kernel[(rows,)](
            x, res, norm.weight, res_out, codes, scales, m, k, float(norm.eps), x.stride(0), res.stride(0),
            res_out.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
            HAS_RESIDUAL=has_res, BLOCK=block, GROUP=group, ROUND_IN_FP32=interpreting(),
            num_warps=norm_num_warps(block), **pdl_launch(x.device))
    return codes, scales


def _quantize(x: torch.Tensor, group: int, norm: NormPrologue | None, codes: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if norm is None:
        return fp8_quantize_activation(x, group, codes, scales)
    return norm.quantize(x, group, codes, scales)


def default_config(m: int, n: int, k: int, group: int) -> Fp8Config:
    """1-64 rows: tensor-core tiles of 16-64 rows (~12 instructions per weight at 1-8 rows, where the CUDA-core
    kernel issues ~16-70), K split to fill the GPU while the fp32 workspace traffic (`8 * M * splits / K` of the
    weight's bytes) stays within a quarter. One row took the split-K CUDA-core kernel that quantizes its own
    activations (`block_m` 1, still selectable by a tuned entry) until the H200 measured the Qwen3-4B batch-1 step
    at 4.02 ms with it against 2.69 for two rows in these tiles (docs/benchmarks.md, fifteenth session). 65 to 1023
    rows: `_mid_config`. Prefill (>= PREFILL_M rows): 128x128 tiles, enough of them (>= 8 row tiles x N / 128), no
    split."""
    if m >= PREFILL_M:
        return Fp8Config(128, 128, 8, 3, 1)
    if m > 64:
        return _mid_config(m, n, k, group)
    bm, block_n = max(16, next_pow2(m)), 64 if m <= SKINNY_MAX_M else 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    splits = min(split_k.num_splits(triton.cdiv(k, group), tiles), max(1, k // (32 * m)))
    return Fp8Config(bm, block_n, 4, 3, splits)


def table_rows(m: int) -> int:
    """The tuned table's row bucket: the power of two at or above `m`, up to TABLE_MAX_M (0: not tuned)."""
    return next_pow2(m) if m <= TABLE_MAX_M else 0


@lru_cache(maxsize=None)
def _tuned_table(device_name: str) -> dict[tuple[int, int, int, int], Fp8Config]:
    return {table_key(e): Fp8Config(*e["config"]) for e in tuned_table.entries(_TABLE, device_name)}


def choose_config(m: int, n: int, k: int, group: int, device: torch.device) -> Fp8Config | None:
    """This GPU's measured best for the shape's row bucket (`_TABLE`), or None (the default rules)."""
    rows = table_rows(m)
    if device.type != "cuda" or not rows:
        return None
    return _tuned_table(torch.cuda.get_device_name(device)).get((rows, n, k, group))


def _mid_config(m: int, n: int, k: int, group: int) -> Fp8Config:
    """65-1023 rows (decode batches, short prefill chunks). 128x128 tiles gave too few programs here: 2 x 20 = 40
    for the down projection (N = 2560) at 256 rows, on 132 SMs, each walking all 76 groups. Rows go in 64-row
    tiles up to 256 rows (and beyond while 128-row tiles would not cover the SMs once), columns in 64 where 128
    would leave SMs idle, and K is split until the launch has MID_PROGRAMS programs, the fp32 workspace traffic
    (`8 * M * splits` bytes per column against `K` of weight) held to the weight stream's size (most of it stays
    in the 50 MB L2 between the GEMM and the reduction)."""
    bm = 64 if m <= 256 or triton.cdiv(m, 128) * triton.cdiv(n, 128) < SMS else 128
    block_n = 128 if triton.cdiv(m, bm) * triton.cdiv(n, 128) >= SMS else 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    splits = 1
    if tiles < MID_PROGRAMS:
        splits = max(1, min(triton.cdiv(k, group), triton.cdiv(MID_PROGRAMS, tiles), k // (8 * m)))
    warps = 8 if bm * block_n >= 128 * 128 else 4
    return Fp8Config(bm, block_n, warps, 3 if warps == 8 else 4, splits)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    scale_row: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Fp8Config | mid.MidConfig | None = None,
    norm: NormPrologue | None = None,
) -> torch.Tensor:
    """W8A8 `x [M, K] @ dequant(weight [N, K]).T (+ bias)` -> `[M, N]` in x's dtype. With `norm`, of
    `rms_norm(x (+ residual))`, the norm done by the activation quantization (the new residual in
    `norm.residual_out`). A `mid_gemm.MidConfig` (the mid table's, where it measured faster at 1-128 rows) runs the
    weight-left mid GEMM on the quantized activations."""
    if x.dim() != 2 or weight.shape[1] != x.shape[1] or scale_row.shape[0] != weight.shape[0]:
        raise ValueError(f"FP8 GEMM: input {tuple(x.shape)}, weight {tuple(weight.shape)} and scale_row "
                         f"{tuple(scale_row.shape)} do not match")
    check_last_dim_contiguous("weight", weight)
    check_last_dim_contiguous("input", x)
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = mid_config("fp8_linear", m, n, k, group, x.device)
    if isinstance(config, mid.MidConfig):
        return _mid_linear(x, weight, scale_inv, scale_row, group, bias, out, norm, config, gated=False)
    if config is None:
        config = choose_config(m, n, k, group, x.device)
        usable = _scaled_mm_usable(x, weight, scale_inv, scale_row, group, bias) if (
            m >= SCALED_MM_MIN_M or (config is not None and config.scaled_mm)) else False
        if config is not None and config.scaled_mm and not usable:
            config = None  # a tuned cuBLASLt entry for operands it cannot take (partial blocks): the default rules
        if usable and (config is None or config.scaled_mm):
            return _scaled_mm_linear(x, weight, scale_inv, group, bias, out, norm)
    if config is not None and config.scaled_mm:
        if not fp8_scaled_mm.shape_fits(x, weight, scale_inv, group, bias):
            raise ValueError("FP8 GEMM: these operands do not have torch._scaled_mm's block-scaled layout")
        return _scaled_mm_linear(x, weight, scale_inv, group, bias, out, norm)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = config or default_config(m, n, k, group)
    skinny = cfg.block_m <= SKINNY_MAX_M
    if cfg.row_groups:
        if cfg.block_m < m:
            raise ValueError(f"a row-streaming config covers at most block_m = {cfg.block_m} rows, got {m}")
        codes, x_scale = _quantize(x, group, norm)
        _fp8_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
            codes, x_scale, weight, scale_inv, scale_row, bias if bias is not None else x_scale, out,
            m, n, k, codes.stride(0), x_scale.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
            GROUP=group, GROUPS_PER_STEP=cfg.row_groups, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, EVEN=m == cfg.block_m and n % cfg.block_n == 0 and k % (cfg.row_groups * group) == 0,
            W_SCALE_UNIFORM=cfg.block_m == 1 and _uniform_tiles(cfg.block_n, scale_row),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
        )
        return out
    # The skinny kernel quantizes its own activation groups; the tensor-core tiles take them from one pass.
    if skinny and norm is not None:
        x = norm.normed(x)
    codes, x_scale = (x, x) if skinny else _quantize(x, group, norm)
    per, splits = split_k.steps_per_split(triton.cdiv(k, group), cfg.k_splits)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    p = split_k.partials(splits, m, n, out, grid[0] * grid[1], fixup=False)
    _fp8_gemm_kernel[grid](
        codes, x_scale, weight, scale_inv, scale_row, bias if bias is not None else x_scale, out, p.workspace,
        p.counter_arg, m, n, k, codes.stride(0), x_scale.stride(0), weight.stride(0), scale_inv.stride(0),
        out.stride(0), GROUP=group, HAS_BIAS=bias is not None, DOT_F32=dot_in_fp32(x.dtype), SKINNY=skinny,
        GROUPS_PER_SPLIT=per, PARTIAL=p.partial, FIXUP=p.fixup, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        FUSE_QUANT=skinny, ROUND_IN_FP32=interpreting(), W_SCALE_UNIFORM=_uniform_tiles(cfg.block_n, scale_row),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    split_k.finish(p, bias, out)
    return out


def fp8_block_linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, scale_row: torch.Tensor, group: int,
    bias: torch.Tensor | None = None, config: mid.MidConfig | None = None,
) -> torch.Tensor:
    """`silu_and_mul(fp8_block_linear(x, weight [gate | up], ...))` -> `[M, N / 2]`: one mid GEMM launch writing the
    activation where the mid table has the shape (or `config` names one), else the GEMM and the SiLU-and-mul kernel."""
    m, k = x.shape
    config = config or mid_config("fp8_linear_silu_mul", m, weight.shape[0], k, group, x.device)
    if config is None:
        return silu_and_mul(fp8_block_linear(x, weight, scale_inv, scale_row, group, bias))
    check_last_dim_contiguous("input", x)
    return _mid_linear(x, weight, scale_inv, scale_row, group, bias, None, None, config, gated=True)


def mid_config(op: str, m: int, n: int, k: int, group: int, device: torch.device) -> mid.MidConfig | None:
    """The mid table's config for FP8 `op` at this shape, where it measured faster than this module's own kernels
    and steps K a group at a time."""
    config = mid.choose_config(op, m, n, k, device)
    return config if config is not None and config.block_k == group else None


def _mid_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, scale_row: torch.Tensor, group: int,
                bias: torch.Tensor | None, out: torch.Tensor | None, norm: NormPrologue | None,
                config: mid.MidConfig, gated: bool) -> torch.Tensor:
    """The quantization pass, then the weight-left mid GEMM on its codes (mid_gemm.py, BLOCK_SCALED)."""
    codes, x_scale = _quantize(x, group, norm)
    uniform = not gated and _uniform_tiles(config.block_n, scale_row)
    return mid.mid_fp8_linear(codes, weight, mid.BlockScales(x_scale, scale_inv, scale_row, group, uniform), x.dtype,
                              bias, out, config=config, gated=gated)


def _uniform_tiles(block_n: int, scale_row: torch.Tensor) -> bool:
    """Whether every `block_n`-column tile lies in one scale block (W_SCALE_UNIFORM of `_fp8_gemm_kernel`)."""
    return fp8_scaled_mm.BLOCK % block_n == 0 and fp8_scaled_mm.regular_blocks(scale_row)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether `device` runs cuBLASLt's block-scaled GEMM and agrees with the Triton kernel (probed once)."""
    return fp8_scaled_mm.available(device, _probe_scaled, _probe_triton)


def _scaled_mm_usable(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, scale_row: torch.Tensor,
                      group: int, bias: torch.Tensor | None) -> bool:
    return (fp8_scaled_mm.shape_fits(x, weight, scale_inv, group, bias) and scaled_mm_available(x.device)
            and fp8_scaled_mm.regular_blocks(scale_row))


def _probe_scaled(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return _scaled_mm_linear(x, weight, scale_inv, fp8_scaled_mm.BLOCK, None, None)


def _probe_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, scale_row: torch.Tensor
                  ) -> torch.Tensor:
    cfg = default_config(x.shape[0], weight.shape[0], x.shape[1], fp8_scaled_mm.BLOCK)
    return fp8_block_linear(x, weight, scale_inv, scale_row, fp8_scaled_mm.BLOCK, config=cfg)


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, group: int,
                      bias: torch.Tensor | None, out: torch.Tensor | None,
                      norm: NormPrologue | None = None) -> torch.Tensor:
    """Quantize x into row-padded codes and M-major scales, then cuBLASLt (fp8_scaled_mm.py)."""
    m, k = x.shape
    rows = fp8_scaled_mm.padded_rows(m)
    codes = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales_t = torch.empty((triton.cdiv(k, group), rows), dtype=torch.float32, device=x.device)
    _quantize(x, group, norm, codes, scales_t.t())
    direct = out if out is not None and rows == m else None
    y = fp8_scaled_mm.block_linear(codes, scales_t, weight, scale_inv, x.dtype, bias, direct)
    if direct is not None:
        return direct
    if out is not None:
        return out.copy_(y[:m])
    return y[:m]
