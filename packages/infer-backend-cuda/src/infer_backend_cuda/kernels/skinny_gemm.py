"""Skinny GEMM (`M <= 8` rows): `out = x @ weight.T (+ bias)`, streaming the weight from HBM once.

At decode batch sizes a linear layer is a weight stream: `N·K·s` bytes against `2·M·N·K` FLOPs, so the
kernel is judged by bandwidth alone. cuBLAS reaches ~70-75 % of the copy bandwidth on Qwen3-4B's per-layer
shapes at M = 1 (docs/kernels.md); this kernel gives each program `BLOCK_N` whole weight rows, walks K in
`BLOCK_K` chunks with independent fp32 products kept in registers (one reduction at the end, no tensor cores:
there is nothing to gain from them at M <= 8), and uses no split-K, so the result is deterministic and one
launch. Many small programs (`BLOCK_N` of 2-8 rows) keep every SM streaming until the end of the grid.

Launch configurations are chosen per (M bucket, N, K) from a table measured on the GPU
(`configs/skinny_gemm.json`, written by `scripts/bench_skinny_gemm.py`), with a shape heuristic otherwise.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import check_last_dim_contiguous, next_pow2

MAX_M = 8
_TABLE = Path(__file__).resolve().parent.parent / "configs" / "skinny_gemm.json"


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * w_stride + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * x_stride + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * out_stride + rn[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def m_bucket(m: int) -> int:
    """The padded row count a launch compiles for: 1, 2, 4 or 8."""
    return next_pow2(m)


@lru_cache(maxsize=None)
def _tuned_table(device_name: str) -> dict[tuple[int, int, int], SkinnyConfig | None]:
    """(M bucket, N, K) -> the measured best config, or None where cuBLAS measured faster."""
    if not _TABLE.exists():
        return {}
    entries = json.loads(_TABLE.read_text()).get(device_name, [])
    return {
        (e["m"], e["n"], e["k"]): (
            SkinnyConfig(e["block_n"], e["block_k"], e["num_warps"], e["num_stages"]) if e["use"] else None
        )
        for e in entries
    }


def heuristic_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Untuned shapes: ~8 KB of weight per K step per program, fewer rows per program as M grows (the
    fp32 product tile is `M x BLOCK_N x BLOCK_K` registers)."""
    bm = m_bucket(m)
    block_k = min(next_pow2(k), 512 if bm <= 2 else 256)
    block_n = 8 if bm == 1 else 4
    return SkinnyConfig(block_n, block_k, 4, 2)


def choose_config(m: int, n: int, k: int, device: torch.device) -> SkinnyConfig | None:
    """The launch config for this shape, or None where this GPU's table says cuBLAS is faster."""
    if device.type == "cuda":
        table = _tuned_table(torch.cuda.get_device_name(device))
        key = (m_bucket(m), n, k)
        if key in table:
            return table[key]
    return heuristic_config(m, n, k)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`x [M, K] @ weight[N, K].T (+ bias [N])` -> `[M, N]` in x's dtype, for `1 <= M <= 8`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_linear takes 1..{MAX_M} rows, got {m}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_last_dim_contiguous("out", out)
    cfg = config or choose_config(m, n, k, x.device) or heuristic_config(m, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=m_bucket(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
