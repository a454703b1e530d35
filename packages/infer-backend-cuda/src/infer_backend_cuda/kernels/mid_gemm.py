"""Mid-size GEMM (2-128 rows, BF16 / FP16; 1-128 rows on block-FP8 codes): `out = x @ weight.T (+ bias)` for decode
batches past the skinny GEMM.

At 9-128 rows a decode linear is still a weight stream: Qwen3-4B's gate / up weight is 99.6 MB against 2.6-5.1
MB of activations, and 2·M FLOPs a weight element stay below the H200's ridge (~175 FLOP/byte at 790 TFLOP/s and
~4.5 TB/s) up to ~128 rows. cuBLAS reaches ~2.2-3.3 TB/s there (64 rows, sixteenth session's profiles:
gate_up on 192x64 tiles, 102 CTAs on 132 SMs; o_proj 64x32 tiles at 2.2 TB/s), and it breaks the step's PDL
chain. Here the weight is the tensor cores' left operand: a program computes `out^T [BLOCK_N, M] = W [BLOCK_N, K]
· x^T [K, M]`, so `BLOCK_N` weight rows fill the MMA's 64-row side (wgmma on Hopper) and all M rows, padded to
16-128, are its narrow side: the weight is read once, the activations (L2-resident) once per column tile.
Narrow outputs (o_proj / down: N = 2560, 20-40 column tiles) split K into ranges whose fp32 partials a reduce launch
sums in a fixed order (split_k.py: deterministic; on an H100 it beat the last program's fix-up at 16-128 rows).

With `gated` the weight is `[gate | up]` and a program's rows are the gate row and the up row of each of its
`BLOCK_N / 2` output columns; its epilogue writes `silu(gate) * up` (skinny_gemm.gated_epilogue): no `[M, 2I]`
intermediate, no SiLU launch.

Block FP8 (`mid_fp8_linear`, asked for by `fp8_gemm.fp8_block_linear` where this table has an `fp8_linear` /
`fp8_linear_silu_mul` entry): the same program on the quantization pass's e4m3 codes, a K step one scale group, each
group's product scaled by the activation's and the weight's scales into the fp32 sum (BLOCK_SCALED).

Launch configurations come from a table measured on the GPU (`configs/mid_gemm.json`, keyed by op, row bucket
2/4/8/16/32/64/128, N and K; written by `packages/infer-backend-cuda/scripts/bench_mid_gemm.py`, which times graph
replays that stream the weight from HBM). A shape the table does not have, or where cuBLAS measured faster,
stays on cuBLAS. At 2-8 rows the skinny GEMM's table is asked first (`CudaMathOps.triton_gemm_config`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import split_k, tuned_table
from infer_backend_cuda.kernels._common import check_last_dim_contiguous, dot_in_fp32, next_pow2, pdl_launch
from infer_backend_cuda.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M
from infer_backend_cuda.kernels.skinny_gemm import gated_epilogue, gated_weight_rows

# From 2 rows: at 2-8 rows it serves the shapes the skinny GEMM's table leaves to cuBLAS (o_proj / down on the
# H200: 40 column tiles without split-K were too few programs), its rows padded to 16. One row is the skinny GEMM's.
MIN_M, MAX_M = 2, 128
OPS = ("linear", "linear_silu_mul")
# Block FP8 (fp8_gemm.py asks for these): from one row, where the FP8 path has no skinny kernel of its own.
FP8_OPS = ("fp8_linear", "fp8_linear_silu_mul")
_TABLE = tuned_table.CONFIGS / "mid_gemm.json"
# INFER_CUDA_MID_GEMM=0: 2-128 rows on cuBLAS whatever the table says (A/B runs). Read once at import, like the other
# INFER_CUDA_ switches.
ENABLED_ENV = "INFER_CUDA_MID_GEMM"
ENABLED = os.environ.get(ENABLED_ENV, "1").strip() != "0"
# INFER_CUDA_MID_GEMM_ALL=1: every tuned shape on its best mid config, also where cuBLAS measured faster alone (A/B
# runs). The tuner times each GEMM alone; in a step the mid GEMM keeps the PDL chain that a cuBLAS launch breaks
# (the next kernel's launch and prologue under its tail), which a lone timing cannot credit: at 64-128 rows several
# shapes were within 0.5 us of cuBLAS on the H100 (nineteenth session).
ALL_ENV = "INFER_CUDA_MID_GEMM_ALL"
ALL = os.environ.get(ALL_ENV, "0").strip() == "1"


class MidConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    k_splits: int = 1  # K cut into at most this many ranges (split_k.py); the gated epilogue takes 1


@triton.jit
def _mid_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, xs_ptr, ws_ptr, row_ptr,
    M, N, K, x_stride, w_stride, out_stride, k_per_split, xs_stride, ws_stride,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FIXUP: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_SCALED: tl.constexpr, W_SCALE_UNIFORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (n, s): column tile n over K range `[s * k_per_split, (s + 1) * k_per_split)`. Rows past M and
    columns past N re-read rows `r mod M` / `c mod N` (their results are never stored), so the main loop loads
    unmasked where K divides evenly. (Not all of them row 0: on the H100, 32 padded rows of a 96-row batch all
    reading row 0 made the gated gate / up GEMM 2x slower than at 128 rows, one L2 line hit by every program.)

    BLOCK_SCALED (block FP8): x is the activation's e4m3 codes with per-row scales `xs [M, groups]`, the weight
    e4m3 with `weight_scale_inv` rows `ws` named per weight row by `row_ptr`; a K step is one group (BLOCK_K), its
    product scaled by both scales before it joins the fp32 sum, as the W8A8 reference sums. W_SCALE_UNIFORM (the
    tile's weight rows in one scale block) loads one weight scale a group and folds it into the row scales: one FMA
    an accumulator element instead of a multiply and an FMA, the same fp32 values."""
    if USE_PDL:  # programmatic dependent launch: start early, read the activations only after their producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if GATED:
        rn, n_mask = gated_weight_rows(pid_n, N, BLOCK_N, True)
        rn_load = rn
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rn_load = rn % N
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rm_load = rm % M
    rk = tl.arange(0, BLOCK_K)
    k_first = pid_k * k_per_split
    k_end = tl.minimum(k_first + k_per_split, K)
    w_ptrs = w_ptr + rn_load.to(tl.int64)[:, None] * w_stride + (k_first + rk)[None, :]
    x_ptrs = x_ptr + rm_load[None, :] * x_stride + (k_first + rk)[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if BLOCK_SCALED:
        # Scales one group ahead, as in fp8_gemm.py: the pipeliner prefetches only the dot's operands.
        if W_SCALE_UNIFORM:
            scale_rows = tl.load(row_ptr + pid_n * BLOCK_N)
        else:
            scale_rows = tl.load(row_ptr + rn_load)
        g_last = tl.cdiv(K, BLOCK_K) - 1
        ws_next = tl.load(ws_ptr + scale_rows * ws_stride + k_first // BLOCK_K)
        xs_next = tl.load(xs_ptr + rm_load * xs_stride + k_first // BLOCK_K)
    for k0 in range(k_first, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            xt = tl.load(x_ptrs)
        else:
            k_mask = (k0 + rk) < k_end
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
        if BLOCK_SCALED:
            w_scale, x_scale = ws_next, xs_next
            g_next = tl.minimum(k0 // BLOCK_K + 1, g_last)
            ws_next = tl.load(ws_ptr + scale_rows * ws_stride + g_next)
            xs_next = tl.load(xs_ptr + rm_load * xs_stride + g_next)
            if DOT_F32:
                product = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                product = tl.dot(w, xt)
            if W_SCALE_UNIFORM:
                acc += product * (w_scale * x_scale)[None, :]
            else:
                acc += product * (w_scale[:, None] * x_scale[None, :])
        elif DOT_F32:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if GATED:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        gated_epilogue(y, out_ptr, out_stride, rm, m_mask, pid_n, N // 2, BLOCK_M, BLOCK_N)
    else:
        split_k.store_tile(y, out_ptr, part_ptr, b_ptr, counter_ptr, rm, rn, m_mask, n_mask, N, out_stride, M * N,
                           pid_k, tl.num_programs(1), pid_n, PARTIAL, HAS_BIAS, FIXUP)


def m_bucket(m: int) -> int:
    """The row count a tuned config is keyed by: 1 (FP8 only), 2, 4, 8, 16, 32, 64 or 128."""
    return next_pow2(m)


def block_m(m: int) -> int:
    """The tile's padded rows (`tl.dot` tiles need at least 16)."""
    return max(16, next_pow2(m))


@lru_cache(maxsize=None)
def _tuned_table(device_name: str) -> dict[tuple[str, int, int, int], MidConfig | None]:
    """(op, row bucket, N, K) -> the measured best config, or None where cuBLAS measured faster (unless `ALL`)."""
    return {
        table_key(e): MidConfig(e["block_n"], e["block_k"], e["num_warps"], e["num_stages"], e["k_splits"])
        if e["use"] or ALL else None
        for e in tuned_table.entries(_TABLE, device_name)
    }


def table_key(entry: dict) -> tuple[str, int, int, int]:
    """(op, row bucket, N, K) of a table entry."""
    return entry["op"], entry["m"], entry["n"], entry["k"]


def choose_config(op: str, m: int, n: int, k: int, device: torch.device) -> MidConfig | None:
    """This GPU's measured best for `op` at the shape's row bucket, or None: cuBLAS (untuned, or faster there)."""
    if op not in OPS + FP8_OPS:
        raise ValueError(f"unknown mid GEMM op {op!r}")
    if not ENABLED or device.type != "cuda" or not (1 if op in FP8_OPS else MIN_M) <= m <= MAX_M:
        return None
    return _tuned_table(torch.cuda.get_device_name(device)).get((op, m_bucket(m), n, k))


class BlockScales(NamedTuple):
    """Block FP8's scales beside e4m3 codes: the activation's per row and group (`x_scale [M, groups]`, from
    `fp8_gemm.fp8_quantize_activation`), the weight's `scale_inv [row blocks, groups]` and `scale_row [N]` (the
    `scale_inv` row of each weight row), in groups of `group` columns."""

    x_scale: torch.Tensor
    scale_inv: torch.Tensor
    scale_row: torch.Tensor
    group: int
    uniform: bool = False  # each column tile's weight rows in one scale block (W_SCALE_UNIFORM); never when gated


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
            config: MidConfig, gated: bool, scales: BlockScales | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"mid GEMM: input {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the mid GEMM takes 1..{MAX_M} rows, got {m}")
    if gated and (n % 2 or config.k_splits != 1):
        raise ValueError("the gated mid GEMM takes an even number of weight rows and one K range")
    if scales is not None and (config.block_k != scales.group or scales.x_scale.shape[0] < m
                               or scales.scale_row.shape[0] != n):
        raise ValueError(f"block-scaled mid GEMM: K steps of {config.block_k} over groups of {scales.group}, "
                         f"x scales {tuple(scales.x_scale.shape)} for {m} rows, scale rows "
                         f"{tuple(scales.scale_row.shape)} for {n} weight rows")
    check_last_dim_contiguous("input", x)
    check_last_dim_contiguous("weight", weight)
    n_out = n // 2 if gated else n
    if out is None:
        out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    check_last_dim_contiguous("out", out)
    per_steps, splits = split_k.steps_per_split(triton.cdiv(k, config.block_k), config.k_splits)
    k_per_split = per_steps * config.block_k
    column_tiles = triton.cdiv(n_out, config.block_n // 2) if gated else triton.cdiv(n, config.block_n)
    p = split_k.partials(splits, m, n, out, column_tiles, fixup=False)
    xs, ws, rows = (scales.x_scale, scales.scale_inv, scales.scale_row) if scales is not None else (x, x, x)
    _mid_gemm_kernel[(column_tiles, splits)](
        x, weight, bias if bias is not None else weight, out, p.workspace, p.counter_arg, xs, ws, rows,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split, xs.stride(0), ws.stride(0),
        HAS_BIAS=bias is not None, PARTIAL=p.partial, FIXUP=p.fixup, GATED=gated,
        BLOCK_M=block_m(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        DOT_F32=dot_in_fp32(out.dtype), BLOCK_SCALED=scales is not None,
        W_SCALE_UNIFORM=scales is not None and scales.uniform and not gated, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_launch(x.device),
    )
    split_k.finish(p, bias, out)
    return out


def mid_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, *, config: MidConfig) -> torch.Tensor:
    """`x [M, K] @ weight [N, K].T (+ bias [N])` -> `[M, N]` in x's dtype, for `1 <= M <= 128`."""
    return _launch(x, weight, bias, out, config, gated=False)


def mid_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, *, config: MidConfig) -> torch.Tensor:
    """`silu_and_mul(x @ weight.T (+ bias))` for `weight = [gate | up]` `[2I, K]` -> `[M, I]`, in one launch."""
    return _launch(x, weight, bias, out, config, gated=True)


def mid_fp8_linear(codes: torch.Tensor, weight: torch.Tensor, scales: BlockScales, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *, config: MidConfig,
                   gated: bool = False) -> torch.Tensor:
    """Block FP8 (W8A8): `sum_g (codes[:, g] @ weight[:, g].T) * x_scale[:, g] * scale_inv[scale_row, g] (+ bias)`
    -> `[M, N]` in `out_dtype`, or with `gated` its `silu_and_mul` -> `[M, N / 2]`; `config.block_k` is the group."""
    return _launch(codes, weight, bias, out, config, gated, scales, out_dtype)
