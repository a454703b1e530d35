"""Split-K for the skinny (decode) GEMMs: how many K ranges to cut, and the fixed-order sum of their partials.

A decode GEMM with one program per column tile launches N / BLOCK_N programs (20 for N = 2560 at 128 columns),
about a seventh of an H200's 132 SMs, each walking all of K: latency-bound, far from the HBM floor. Cutting K
into ranges gives a few programs per SM; each writes fp32 partial sums to a workspace `[splits, M, N]`, and one
small kernel adds them in split order (deterministic, unlike atomics) with the bias.

Two ways to sum, chosen per kernel (`partials(..., fixup=)`): the fix-up, where the program that finishes a tile
last (an arrival counter per tile, `last_arrival`) adds the partials in the same split order, so the output is the
reduce kernel's bit for bit with one launch fewer; or the reduce launch. The fix-up's sum is its launch's tail (every
program stores and counts in before the last one may load them all), so it pays where launches are many and short:
the AWQ GEMMs keep it (H200, eighth session: the batch-1 replay 3.290 -> 3.154 ms; H100, thirty-second: 2.60 against
2.73 ms at one row, 3.68 against 3.73 at eight). The mid GEMM (BF16 and block FP8) and the FP8 GEMMs take the reduce
launch (H100, thirty-second session: BF16 replays -0.05 ms at 16 and 64 rows; FP8 -0.07 / -0.11 / -0.08 ms at 1 / 16
/ 64 rows; the mid GEMM's down at 96-128 rows 1.8-2.2 us faster alone; docs/benchmarks.md).
`INFER_CUDA_SPLIT_K_FIXUP=1` / `0` puts every kernel on the fix-up / the reduce launch (A/B runs).
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import count_switch, next_pow2, on_off_switch, pdl_launch
from infer_backend_cuda.kernels.activation import silu_mul

# A few programs per SM of an H100/H200 (132 SMs). INFER_CUDA_SPLIT_K_TARGET_PROGRAMS sets it for A/B runs (every
# split kernel's default split count; tuned-table configs keep theirs).
TARGET_PROGRAMS_ENV = "INFER_CUDA_SPLIT_K_TARGET_PROGRAMS"


def target_programs(environ: Mapping[str, str] = os.environ) -> int:
    return count_switch(environ, TARGET_PROGRAMS_ENV, 512, 1, None, "a positive count of programs")


TARGET_PROGRAMS = target_programs()

# INFER_CUDA_SPLIT_K_FIXUP: unset, each kernel's own sum (module docstring); 1 the fix-up everywhere, 0 the reduce
# launch everywhere (A/B runs). Read once at import, like kernels/_common.PDL_ENV (and not under RUSTINFER_, the
# config loader's prefix, which refuses names it does not know).
FIXUP_ENV = "INFER_CUDA_SPLIT_K_FIXUP"


def fixup_override(environ: Mapping[str, str] = os.environ) -> bool | None:
    """The switch's choice for every kernel, or None (unset or empty): each kernel's own."""
    return on_off_switch(environ, FIXUP_ENV, "the fix-up everywhere", "the reduce launch everywhere")


FIXUP_OVERRIDE = fixup_override()


def fixup_chosen(kernel_default: bool) -> bool:
    """Whether a kernel whose own choice is `kernel_default` sums by the fix-up."""
    return kernel_default if FIXUP_OVERRIDE is None else FIXUP_OVERRIDE


# The arrival counters: one int32 per tile of a launch, zero between launches (each launch's last arrivals set
# theirs back to 0). Owner: one buffer per device, allocated when the backend is built (`allocate_counters`,
# called by `CudaBackend.__init__`, before any warm-up or graph capture), not per weight: every GEMM of a step
# runs on the one compute stream, one after another (under PDL a kernel touches memory only after `gdc_wait`,
# i.e. after the previous grid has ended), so launches never overlap in time and can share one buffer, and its
# size need not follow each weight's configs. 64 Ki counters (256 KiB) cover far more than the default configs
# ever split (below ~264 tiles a launch: `num_splits`, fp8_gemm's `_mid_config`); a launch with more tiles (an
# explicit config) sums with the reduce kernel. A graph captures the buffer's address, valid for the process.
COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def num_splits(k_steps: int, column_tiles: int) -> int:
    """How many K ranges to ask for, given `k_steps` K steps of a program and `column_tiles` programs per split."""
    return max(1, min(k_steps, TARGET_PROGRAMS // max(1, column_tiles)))


def steps_per_split(k_steps: int, splits: int) -> tuple[int, int]:
    """(K steps per range, number of ranges) for at most `splits` ranges that each hold whole steps."""
    per = triton.cdiv(k_steps, max(1, splits))
    return per, triton.cdiv(k_steps, per)


@triton.jit
def last_arrival(counter_ptr, arrivals):
    """Count this program's arrival on the counter at `counter_ptr`, after all of its stores: whether it is the last
    of `arrivals` programs, which may then read every other one's stores and must set the counter back to 0 (the
    split-K fix-up below, the decode attention's split merge, the GDN decode mixer's group norm).

    Memory order (CUTLASS's split-K semaphore pattern): the barrier orders all of the CTA's stores before the
    counter update, which one thread issues (Triton's scalar atomic) with release semantics at GPU scope, so the
    stores are visible GPU-wide before the count; the last arriver's acquire then sees every other program's stores
    (each released before its own increment, which the last one read through the counter's modification order).
    Its threads learn the count through shared memory; a caller whose threads then read what other threads of its
    own CTA stored puts a barrier first. Other programs' stores are read with `.cg` (L2 only): L1 is not coherent
    across SMs. The reset is a plain store: the next launch that uses the counter starts after this grid ends
    (stream order, or `gdc_wait` under PDL)."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1


# Partial tiles a fix-up asks for at once: as many as SUM_CHUNK_ELEMENTS fp32 values make (32 registers a thread on 2
# warps), 4 to 16 tiles (the old loop, unrolled by ptxas, had 4 in flight). Tiles over 1024 values keep that loop:
# with 4 explicit, the AWQ 32 x 128 tile compiled to 251 registers instead of 168 (sm_90, `sass_census.py`).
# INFER_CUDA_SPLIT_K_SUM_CHUNK sets it for A/B runs (0: the old loop everywhere).
SUM_CHUNK_ENV = "INFER_CUDA_SPLIT_K_SUM_CHUNK"


def sum_chunk_elements(environ: Mapping[str, str] = os.environ) -> int:
    return count_switch(environ, SUM_CHUNK_ENV, 2048, 0, None, "a count of fp32 values (0: the one-tile loop)")


SUM_CHUNK_ELEMENTS = tl.constexpr(sum_chunk_elements())


@triton.jit
def _sum_splits(total, ws_ptr, rm, cols, mask, N, split_stride, splits):
    """`total` plus the partials of rows `rm`, columns `cols` of every range, in split order, read with `.cg` (L2).
    The loads go out a chunk of ranges at a time (masked past the last range: `x + 0.0` is x), their sums after:
    each is an L2 round trip (~0.2-0.3 us) that a load-then-add loop pays once a range (ptxas unrolled it by 4:
    eight trips for the 32 ranges of the one-row AWQ o_proj), at the end of the GEMM's critical path."""
    TILE: tl.constexpr = total.shape[0] * total.shape[1]
    CHUNK: tl.constexpr = 1 if SUM_CHUNK_ELEMENTS == 0 or TILE > 1024 else max(4, min(16, SUM_CHUNK_ELEMENTS // TILE))
    if CHUNK == 1:  # the tiled kernels' wider tiles: the old loop (ptxas keeps 4 in flight, in its registers)
        for s in range(0, splits):
            total += tl.load(ws_ptr + s * split_stride + rm[:, None] * N + cols[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg")
    else:
        offsets = rm[:, None] * N + cols[None, :]
        for s0 in range(0, splits, CHUNK):
            parts = ()
            for i in tl.static_range(CHUNK):
                in_range = (s0 + i + 0 * cols) < splits  # a vector: the 3.9 interpreter refuses `mask & bool`
                parts = parts + (tl.load(ws_ptr + (s0 + i) * split_stride + offsets, mask=mask & in_range[None, :],
                                         other=0.0, cache_modifier=".cg"),)
            for i in tl.static_range(CHUNK):
                total += parts[i]
    return total


@triton.jit
def _fixup(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, mask, n_mask, N, out_stride, split_stride, splits,
           tile, HAS_BIAS: tl.constexpr):
    """After this program's partial is stored: the last of the tile's `splits` programs (`last_arrival`) sums every
    partial in split order (the reduce kernel's sum, bit for bit), adds the bias, writes the output and sets the
    counter back to 0. The partials are loaded with `.cg` (L2 only)."""
    if last_arrival(counter_ptr + tile, splits):
        tl.debug_barrier()
        total = _sum_splits(tl.zeros_like(acc), ws_ptr, rm, cols, mask, N, split_stride, splits)
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(counter_ptr + tile, 0)


@triton.jit
def store_tile(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask, N, out_stride, split_stride,
               split, splits, tile, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, FIXUP: tl.constexpr):
    """A program's fp32 tile `acc [rows rm, columns cols]`: with PARTIAL, range `split`'s partial sums into the
    workspace (`ws_ptr + split * split_stride`, rows N apart; the bias waits for the sum), and with FIXUP the last
    of the tile's `splits` programs (tile number `tile`) sums them into the output (`_fixup`); else, plus the
    bias, the output in its dtype."""
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(ws_ptr + split * split_stride + rm[:, None] * N + cols[None, :], acc, mask=mask)
        if FIXUP:
            _fixup(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, mask, n_mask, N, out_stride, split_stride,
                   splits, tile, HAS_BIAS)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def store_gated_tile(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask, gate_cols, N, out_stride,
                     split_stride, split, splits, tile, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     HALF_N: tl.constexpr):
    """A gated GEMM's tile (weight `[gate | up]`, N columns): `acc [rows rm, columns cols]` holds gate and up columns
    in any order, stored as range `split`'s partial sums (also with one range: `gated_partials`); the last of the
    tile's `splits` programs sums gate columns `gate_cols` (`HALF_N` of them) and their up twins (`+ N / 2`) in split
    order, adds the bias, and writes `silu(gate) * up` to `out [M, N / 2]`, rounded as the unfused GEMM and
    `silu_and_mul` round (each sum to the output dtype, then the product)."""
    tl.store(ws_ptr + split * split_stride + rm[:, None] * N + cols[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])
    if last_arrival(counter_ptr + tile, splits):
        tl.debug_barrier()
        half = N // 2
        g_mask = gate_cols < half
        mask = m_mask[:, None] & g_mask[None, :]
        zero = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
        gate = _sum_splits(zero, ws_ptr, rm, gate_cols, mask, N, split_stride, splits)
        up = _sum_splits(zero, ws_ptr, rm, gate_cols + half, mask, N, split_stride, splits)
        if HAS_BIAS:
            gate += tl.load(b_ptr + gate_cols, mask=g_mask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + half + gate_cols, mask=g_mask, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        act = silu_mul(gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32))
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + gate_cols[None, :], act.to(dt), mask=mask)
        tl.store(counter_ptr + tile, 0)


@triton.jit
def _split_reduce_kernel(ws_ptr, b_ptr, out_ptr, N, out_stride, split_stride,
                         SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: start early, read the partials only after the GEMM ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m, pid = tl.program_id(0), tl.program_id(1)
    rn = pid * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * split_stride + m * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * out_stride + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def workspace(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((splits, m, n), dtype=torch.float32, device=device)


def reduce_splits(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """`out = sum(ws, dim=0) (+ bias)` in out's dtype; ws `[splits, M, N]` fp32 contiguous."""
    splits, m, n = ws.shape
    block = min(1024, next_pow2(n))
    _split_reduce_kernel[(m, triton.cdiv(n, block))](
        ws, bias if bias is not None else ws, out, n, out.stride(0), m * n,
        SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_launch(out.device),
    )


def _key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def allocate_counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters, zeroed, allocated now unless the switch puts every kernel on the reduce launch
    (never under graph capture: there the zeroing would not run until a replay); None then."""
    if FIXUP_OVERRIDE is False:
        return None
    key = _key(device)
    if key not in _counters:
        _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=key)
    return _counters[key]


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters if allocated."""
    return _counters.get(_key(device))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counters_for(tiles: int, device: torch.device, fixup: bool = True) -> torch.Tensor | None:
    """The arrival counters for a launch of `tiles` last-arriver tiles (this module's fix-up, or another kernel's
    merge of the same pattern) whose own choice is `fixup`, or None: the fix-up is not chosen (`fixup_chosen`), the
    launch has more tiles than counters, or none exist and the stream is capturing (the zeroing of a new buffer
    would not run until a replay)."""
    if not fixup_chosen(fixup) or tiles > COUNTERS:
        return None
    cnt = counters(device)
    if cnt is None and not _capturing(device):
        cnt = allocate_counters(device)
    return cnt


class Partials(NamedTuple):
    """Where a launch's programs write: `workspace` (`[splits, M, N]` fp32, or the output itself when K is not
    split) and `counters` (the arrival counters when the last program of a tile sums, else None)."""

    splits: int
    workspace: torch.Tensor
    counters: torch.Tensor | None

    @property
    def partial(self) -> bool:
        return self.splits > 1

    @property
    def fixup(self) -> bool:
        return self.counters is not None

    @property
    def counter_arg(self) -> torch.Tensor:
        """The kernels' counter pointer (unused without the fix-up)."""
        return self.counters if self.counters is not None else self.workspace


def partials(splits: int, m: int, n: int, out: torch.Tensor, tiles: int, fixup: bool) -> Partials:
    """The targets of a launch with `splits` K ranges and `tiles` output tiles per range, from a kernel whose own sum
    is the fix-up (`fixup`) or the reduce launch: with the fix-up chosen, the device's counters if they cover `tiles`
    and exist or can be made now (not under capture, so the backend makes them first); else a workspace that
    `finish` reduces."""
    if splits == 1:
        return Partials(1, out, None)
    return Partials(splits, workspace(splits, m, n, out.device), counters_for(tiles, out.device, fixup))


def gated_partials(splits: int, m: int, n: int, device: torch.device, tiles: int) -> Partials | None:
    """The targets of a gated launch (`store_gated_tile`): always a workspace, even for one range (the activation
    needs both halves summed, which only the last arriver of a tile holds), and the counters; None where the
    fix-up is switched off or no counters serve `tiles`: the caller then runs the GEMM and `silu_and_mul`."""
    cnt = counters_for(tiles, device)
    return None if cnt is None else Partials(splits, workspace(splits, m, n, device), cnt)


def finish(p: Partials, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """The reduce launch of a split GEMM without the fix-up."""
    if p.partial and not p.fixup:
        reduce_splits(p.workspace, bias, out)
