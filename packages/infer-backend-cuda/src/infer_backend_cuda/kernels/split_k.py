"""Split-K for the skinny (decode) GEMMs: how many K ranges to cut, and the fixed-order sum of their partials.

A decode GEMM with one program per column tile launches N / BLOCK_N programs (20 for N = 2560 at 128 columns),
about a seventh of an H200's 132 SMs, each walking all of K: latency-bound, far from the HBM floor. Cutting K
into ranges gives a few programs per SM; each writes fp32 partial sums to a workspace `[splits, M, N]`, and one
small kernel adds them in split order (deterministic, unlike atomics) with the bias.

By default there is no second kernel (the fix-up; `INFER_CUDA_SPLIT_K_FIXUP=0` brings the reduce launch back for
A/B runs): the program that finishes a tile last (an arrival counter per tile, `_fixup`) adds the partials in the
same split order, so the output is the reduce kernel's bit for bit, one launch fewer per split GEMM (144 a
Qwen3-4B AWQ decode step: on the H200 its batch-1 replay 3.290 -> 3.154 ms; FP8's 3.465 -> 3.484, unchanged
within the run's noise; docs/benchmarks.md, eighth session).

The sum is the launch's tail: every program stores its partial and counts in, and only then may the last one load
them all. With the early check (`INFER_CUDA_SPLIT_K_EARLY_LAST=1`; off by default until measured on a GPU) a program
first reads its tile's count: the one that finds every other range already in (the usual last finisher) sums at
once, its own range from its registers, and skips its store, the release that waits for that store, and one partial
load; a program that comes in while another is still running stores and counts in as before. The same sums in the
same order: the bits do not change.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch

# A few programs per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 512

# INFER_CUDA_SPLIT_K_FIXUP (default 1): the last program of a tile sums the partials instead of a reduce launch;
# 0 for the reduce kernel (A/B runs). Read once at import, like kernels/_common.PDL_ENV (and not under RUSTINFER_,
# the config loader's prefix, which refuses names it does not know).
FIXUP_ENV = "INFER_CUDA_SPLIT_K_FIXUP"


def fixup_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(FIXUP_ENV, "1").strip() != "0"


FIXUP = fixup_wanted()

# INFER_CUDA_SPLIT_K_EARLY_LAST (default 0): 1 turns on the fix-up's early check (module docstring). Off until it has
# run on a GPU: its GPU tests and timings are the next device call's (scripts/device_session31.sh CALL=early).
EARLY_LAST_ENV = "INFER_CUDA_SPLIT_K_EARLY_LAST"


def early_last_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(EARLY_LAST_ENV, "0").strip() == "1"


EARLY_LAST = early_last_wanted()
# The kernels' FIXUP constexpr: no fix-up (the reduce launch sums), the last arrival sums, or the early check first.
FIXUP_OFF, FIXUP_LAST, FIXUP_EARLY = 0, 1, 2

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


@triton.jit
def _write_sum(acc, own_split, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, mask, n_mask, N, out_stride, split_stride,
               splits, tile, HAS_BIAS: tl.constexpr, OWN_IN_REGISTERS: tl.constexpr):
    """Every range's partial summed in split order (the reduce kernel's sum, bit for bit; loaded with `.cg`, L2 only),
    plus the bias, written to the output; the tile's counter set back to 0. OWN_IN_REGISTERS: range `own_split`'s
    partial is `acc` (this program never stored it)."""
    total = tl.zeros_like(acc)
    for s in range(0, splits):
        part_ptrs = ws_ptr + s * split_stride + rm[:, None] * N + cols[None, :]
        if OWN_IN_REGISTERS:  # (a tile-shaped test: the interpreter takes no scalar-broadcast mask)
            theirs = tl.full(acc.shape, s, tl.int32) != own_split
            part = tl.load(part_ptrs, mask=mask & theirs, other=0.0, cache_modifier=".cg")
            total += tl.where(theirs, part, acc)
        else:
            total += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(counter_ptr + tile, 0)


@triton.jit
def store_tile(acc, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, m_mask, n_mask, N, out_stride, split_stride,
               split, splits, tile, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, FIXUP: tl.constexpr):
    """A program's fp32 tile `acc [rows rm, columns cols]`: with PARTIAL, range `split`'s partial sums into the
    workspace (`ws_ptr + split * split_stride`, rows N apart; the bias waits for the sum), and with FIXUP (FIXUP_LAST
    or FIXUP_EARLY) the last of the tile's `splits` programs (tile number `tile`) sums them into the output; with
    FIXUP_EARLY a program that finds the other ranges all in before it stores sums at once instead (module
    docstring). Else, plus the bias, the output in its dtype."""
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        early = False
        if FIXUP == 2:  # FIXUP_EARLY: the count read (an add of 0) with acquire: each range counted released its part
            early = tl.atomic_add(counter_ptr + tile, 0, sem="acquire", scope="gpu") == splits - 1
        if early:
            tl.debug_barrier()  # the count reached every thread (through shared memory) before their loads
            _write_sum(acc, split, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, mask, n_mask, N, out_stride,
                       split_stride, splits, tile, HAS_BIAS, True)
        else:
            tl.store(ws_ptr + split * split_stride + rm[:, None] * N + cols[None, :], acc, mask=mask)
            if FIXUP:
                if last_arrival(counter_ptr + tile, splits):
                    tl.debug_barrier()
                    _write_sum(acc, split, out_ptr, ws_ptr, b_ptr, counter_ptr, rm, cols, mask, n_mask, N,
                               out_stride, split_stride, splits, tile, HAS_BIAS, False)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


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
    """The device's arrival counters, zeroed, allocated now if the fix-up is on (never under graph capture: there
    the zeroing would not run until a replay); None with the fix-up off."""
    if not FIXUP:
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


def counters_for(tiles: int, device: torch.device) -> torch.Tensor | None:
    """The arrival counters for a launch of `tiles` last-arriver tiles (this module's fix-up, or another kernel's
    merge of the same pattern), or None: the fix-up is off, the launch has more tiles than counters, or none exist
    and the stream is capturing (the zeroing of a new buffer would not run until a replay)."""
    if not FIXUP or tiles > COUNTERS:
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
    def fixup(self) -> int:
        """The kernels' FIXUP constexpr: FIXUP_OFF without counters (`finish` launches the reduce kernel), else
        FIXUP_EARLY or, with the early check switched off, FIXUP_LAST."""
        if self.counters is None:
            return FIXUP_OFF
        return FIXUP_EARLY if EARLY_LAST else FIXUP_LAST

    @property
    def counter_arg(self) -> torch.Tensor:
        """The kernels' counter pointer (unused without the fix-up)."""
        return self.counters if self.counters is not None else self.workspace


def partials(splits: int, m: int, n: int, out: torch.Tensor, tiles: int) -> Partials:
    """The targets of a launch with `splits` K ranges and `tiles` output tiles per range: with the fix-up on, the
    device's counters if they cover `tiles` and exist or can be made now (not under capture, so the backend makes
    them first); else a workspace that `finish` reduces."""
    if splits == 1:
        return Partials(1, out, None)
    return Partials(splits, workspace(splits, m, n, out.device), counters_for(tiles, out.device))


def finish(p: Partials, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """The reduce launch of a split GEMM without the fix-up."""
    if p.partial and not p.fixup:
        reduce_splits(p.workspace, bias, out)
