"""Is the mid GEMM at 64-128 rows bound by the activation tiles re-read from L2, not by the weight stream?

Each `BLOCK_N`-row weight tile's program reads all M activation rows over K again: at 128 rows and 64-row tiles
that is twice the weight bytes, from L2 (gate_up at 128 rows on the H100: 99.6 MB of weights, ~200 MB of
activation tile loads in ~43 us, ~7 TB/s of L2 traffic, against ~34 us for the weight bytes at the copy rate).
This probe times the mid GEMM's loop shape three ways, in CUDA graphs over copies of the weight (so it streams
from HBM): `full` (weights and activations per K step, as `mid_gemm.py`), `x_once` (the activation tile loaded once
before the loop: the weight stream and the MMAs alone; the result is wrong), `w_once` (the weight tile once: the
activation traffic and the MMAs alone); at 96 rows also `split64_32` (the rows as a 64- and a 32-row tile, two
dots, instead of 128 padded: a quarter less activation traffic). Also the product kernel (`mid_linear`) and
cuBLAS for reference, and `tma` (the full loop with both tiles by TMA, no per-thread address arithmetic).
If `x_once` is near the weight floor and `full` near `w_once`, the lever is fewer activation re-reads (wider
weight tiles a program, activations held across column tiles, or multicast), not the weight stream.

Usage (GPU): python packages/infer-backend-cuda/scripts/probe_mid_l2.py --ms 16,64,128
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda.kernels import mid_gemm as G, split_k

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
MODES = {"full": 0, "x_once": 1, "w_once": 2}


@triton.jit
def _probe_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M2: tl.constexpr):
    """MODE 0 full, 1 x once, 2 w once; BLOCK_M2 > 0: the rows as two tiles, BLOCK_M and BLOCK_M2 (96 = 64 + 32
    rows instead of 128 padded), each its own dot and accumulator."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rm = tl.arange(0, BLOCK_M) % M
    rm2 = (BLOCK_M + tl.arange(0, max(BLOCK_M2, 16))) % M
    rk = tl.arange(0, BLOCK_K)
    k_first = pid_k * k_per_split
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + (k_first + rk)[None, :]
    x_ptrs = x_ptr + rm[None, :] * K + (k_first + rk)[:, None]
    x2_ptrs = x_ptr + rm2[None, :] * K + (k_first + rk)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, max(BLOCK_M2, 16)), dtype=tl.float32)
    w0 = tl.load(w_ptrs)
    x0 = tl.load(x_ptrs)
    for _ in range(k_first, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        w = w0 if MODE == 2 else tl.load(w_ptrs, eviction_policy="evict_first")
        xt = x0 if MODE == 1 else tl.load(x_ptrs)
        acc = tl.dot(w, xt, acc)
        if BLOCK_M2 > 0:
            acc2 = tl.dot(w, tl.load(x2_ptrs), acc2)
            x2_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    if BLOCK_M2 > 0:
        offs_m2 = BLOCK_M + tl.arange(0, max(BLOCK_M2, 16))
        mask2 = (offs_n < N)[:, None] & (offs_m2 < M)[None, :]
        tl.store(out_ptr + pid_k * M * N + offs_m2[None, :] * N + offs_n[:, None], acc2, mask=mask2)


@triton.jit
def _probe_tma_kernel(x_desc, w_desc, out_ptr, M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The full loop with both tiles by TMA (host tensor descriptors; rows past M / N come back as zeros)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    k_first = pid_k * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_first, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k0])
        x = x_desc.load([0, k0])
        acc = tl.dot(w, x.T, acc)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)


def tma_call(x: torch.Tensor, w: torch.Tensor, part: torch.Tensor, per: int, splits: int, bn: int, bk: int,
             warps: int, stages: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    _probe_tma_kernel[(triton.cdiv(n, bn), splits)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), part, m, n, k, per,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _time(call) -> float | str:  # noqa: ANN001 - a call(i) for graph_replay_us
    try:
        return round(graph_replay_us(call, 3), 2)
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
        return f"{type(exc).__name__}: {str(exc)[:80]}"


def _variants(x: torch.Tensor, w: list[torch.Tensor], out: torch.Tensor, tile: str, splits: int,
              modes: list[str]) -> dict[str, float | str]:
    """Every asked variant at one tile and split count, keyed `variant_tile[/splits]`."""
    (m, k), n = x.shape, w[0].shape[0]
    bn, bk, warps, stages = (int(v) for v in tile.split(":"))
    per = triton.cdiv(triton.cdiv(k, bk), splits) * bk
    splits = triton.cdiv(k, per)
    part = torch.empty((splits, m, n), device=x.device, dtype=torch.float32)
    cfg = G.MidConfig(bn, bk, warps, stages, splits)
    tag = f"{tile}/{splits}" if splits > 1 else tile
    row = {}
    if "mid" in modes:
        row[f"mid_{tag}"] = _time(lambda i: G.mid_linear(x, w[i], out=out, config=cfg))
    for mode, chosen in (("mid_fixup", True), ("mid_reduce", False)):  # the split-K sum forced one way (split_k.py)
        if mode in modes and splits > 1:
            before, split_k.FIXUP_OVERRIDE = split_k.FIXUP_OVERRIDE, chosen
            row[f"{mode}_{tag}"] = _time(lambda i: G.mid_linear(x, w[i], out=out, config=cfg))
            split_k.FIXUP_OVERRIDE = before
    variants = [(mode, MODES[mode]) for mode in modes if mode in MODES]
    if m == 96 and "split64_32" in modes:
        variants.append(("split64_32", 3))
    for mode, code in variants:
        def call(i: int, code: int = code) -> None:
            two = code == 3
            _probe_kernel[(triton.cdiv(n, bn), splits)](
                x, w[i], part, m, n, k, per, MODE=0 if two else code,
                BLOCK_M=64 if two else max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
                BLOCK_M2=32 if two else 0, num_warps=warps, num_stages=stages)
        row[f"{mode}_{tag}"] = _time(call)
    if "tma" in modes:
        row[f"tma_{tag}"] = _time(lambda i: tma_call(x, w[i], part, per, splits, bn, bk, warps, stages))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,64,96,128")
    ap.add_argument("--shapes", default="gate_up,down,qkv")
    ap.add_argument("--tiles", default="64:64:4:3,64:128:4:4,128:64:8:4")
    ap.add_argument("--splits", default="", help="K ranges to time (e.g. 3,6); default 1 at N >= 6144, else 3")
    ap.add_argument("--modes", default="mid,full,x_once,w_once,split64_32,tma",
                    help="of mid, mid_fixup, mid_reduce, full, x_once, w_once, split64_32, tma")
    args = ap.parse_args()
    dev = torch.device("cuda")
    split_k.allocate_counters(dev)
    bw = copy_bandwidth()
    modes = args.modes.split(",")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        ws = [torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
        splits_list = [int(v) for v in args.splits.split(",")] if args.splits else [1 if n >= 6144 else 3]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            out = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
            row = {"shape": shape, "m": m, "floor_us": round(n * k * 2 / bw * 1e6, 2),
                   "cublas_us": _time(lambda i: torch.matmul(x, ws[i].T, out=out))}
            for tile in args.tiles.split(","):
                for splits in splits_list:
                    row |= _variants(x, ws, out, tile, splits, modes)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
