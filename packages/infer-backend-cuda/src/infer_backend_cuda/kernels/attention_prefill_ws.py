"""Paged prefill attention for Hopper in Gluon, warp-specialised: one producer warp feeds the key / value tiles by
TMA, page by page, into rings of shared memory guarded by mbarriers; two consumer warpgroups, each its own
partition with 64 of the tile's 128 query rows, run the MMAs and the softmax without ever waiting for each other.

The same contract as `attention_prefill.paged_attention_prefill` (ragged query chunks attending causally to their
sequence's paged context, GQA rows packed `(token, query head)`, the flattened longest-first grid, single-token
sequences skipped in mixed steps); see that module for the row packing and the masks. Each consumer runs
FlashAttention-3's intra-warpgroup overlap:

    S_j = Q K_j^T              (wgmma, async)
    O  += P_{j-1} V_{j-1}      (wgmma, async, P from registers)
    wait until one group is in flight: S_j is ready, P_{j-1} V_{j-1} still runs
    softmax of S_j -> P_j, the rescale factor
    wait for P_{j-1} V_{j-1}; O *= the rescale factor

(Triton's pipeliner waits for every scores MMA at once before the softmax that reads it, so there the tensor cores
idle during each tile's softmax.) Who moves the bytes and how the stages are handed over:

- A page of one KV head is 16 rows of `head_dim` strided by `Hkv * head_dim` in the cache viewed as
  `[num_blocks * page, Hkv * head_dim]`: one TMA box. A 128-key tile is `128 / page` boxes into slices of its stage,
  all counted on the stage's ready barrier (the expected bytes of the whole tile). Pages past the tile's last
  visible key get a row coordinate past the tensor, which TMA fills with zeros; the producer reads no block-table
  entry past the context.
- Each consumer warpgroup arrives on a stage's free barrier (count 2) once its MMA reading the stage has retired;
  the producer waits on it before reusing the stage. No CTA barrier in the loop: the two warpgroups drift apart,
  so one's softmax runs under the other's MMAs. (The twenty-fourth session's kernel, all 8 warps gathering pages by
  `cp.async` with a CTA barrier an iteration, ran this loop 5-10 % below the Triton kernel; this one runs 40 % above.)
- Rows of the last tile past its last visible key may hold anything (a page's unused rows, NaN in the tests): their
  scores are masked, but 0 * NaN in the value MMA is NaN, so each consumer zeroes those value rows in shared memory
  before its last value MMA (the other warpgroup writes the same zeros).

Only head_dim 128 in bf16 / fp16 on sm_90, with a cache whose pages are contiguous `[page, Hkv, head_dim]` blocks
(`supported`); everything else runs the Triton kernel. On by default; `INFER_CUDA_WS_PREFILL=0` serves the Triton
kernel instead (A/B runs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from infer_backend_cuda.kernels._common import check_last_dim_contiguous, interpreting, pdl_launch
from infer_backend_cuda.kernels._ragged import grid_tiles, ragged_block_b

# Names that moved between Triton 3.6 (the device image) and 3.9 (this workspace).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

HEAD_DIM = 128
BLOCK_M = 128  # (token, query head) rows a program: two consumer warpgroups of 64
HALF_M = BLOCK_M // 2
BLOCK_N = 128
# K and V tiles in flight (a ring of STAGES each). Two keep Q in shared memory (the scores MMA's A from there, 160
# KB); three hold Q in registers (32 a thread) to make room for the third stage (192 KB of tiles). A/B switch.
STAGES = int(os.environ.get("INFER_CUDA_WS_PREFILL_STAGES", "2"))
CONSUMER_WARPS = 4  # a warpgroup a consumer; the producer is one warp (`_prefill_kernel`'s `[num_warps, 1]`)
# Registers a thread in each worker partition (the second consumer warpgroup, the producer warp): the 12 warps (three
# warpgroups, the producer's padded) launch with 168 each (65,536 / 384, rounded down to 8); the first consumer
# gets what is left, 240 (at 224 / 40 the consumers spilled on Triton 3.6).
WORKER_REGS = (240, 24)
if STAGES not in (2, 3):
    raise ValueError(f"INFER_CUDA_WS_PREFILL_STAGES={STAGES}: 2 or 3 (shared memory)")
# INFER_CUDA_WS_PREFILL=0 serves the Triton kernel where this one could (A/B runs). Read once at import.
ENABLED_ENV = "INFER_CUDA_WS_PREFILL"
ENABLED = os.environ.get(ENABLED_ENV, "1").strip() != "0"
# INFER_CUDA_WS_PREFILL_ABOVE: this kernel serves launches whose longest query (`max_query_len`; a captured mixed
# graph's is its token bucket) is longer than this; shorter ones the Triton kernel. A short chunk gives each of its
# few programs one or two key tiles, where this kernel's set-up (barriers, descriptors, the producer warp) is not
# paid back: the chat mixed step (96 decodes, H100, thirtieth session) took 7.30-7.33 ms on the Triton kernel against
# 7.53-7.54 at a 32-token chunk (128-token graph), 8.29-8.38 against 8.42-8.43 at 96 and 8.56 against 8.59 at 160
# (256-token graph), 10.86 against 10.83 at 250 (512); a 500-token chunk beside 12 decodes at 3k context 10.92
# against 10.30 (WS). 0: every launch it can serve. Read once at import.
ABOVE_ENV = "INFER_CUDA_WS_PREFILL_ABOVE"
_ABOVE_RAW = os.environ.get(ABOVE_ENV, "256").strip()
if not _ABOVE_RAW.isdigit():
    raise ValueError(f"{ABOVE_ENV}={_ABOVE_RAW!r}: a query length in tokens (0 or more)")
ABOVE = int(_ABOVE_RAW)
# INFER_CUDA_WS_PREFILL_PDL=0 launches it without programmatic dependent launch (A/B runs: in a mixed step it sits
# between the q/k norm + RoPE + store and the decode attention, both launched under PDL). Read once at import.
PDL = os.environ.get("INFER_CUDA_WS_PREFILL_PDL", "1").strip() != "0"


# Reductions through gl.reduce with Gluon combine functions: gl.sum / gl.max wrap triton.language's, which are
# interpreter functions when TRITON_INTERPRET=1 (the CPU test run) and then do not compile for sm_90.
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _grid_dependency(instruction: gl.constexpr):
    """A `griddepcontrol` instruction (Triton's `gdc_wait` / `gdc_launch_dependents` are not Gluon builtins)."""
    gl.inline_asm_elementwise(instruction + " // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_sequence(cu_ptr, n_seq, tile, BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, GROUP: gl.constexpr,
                   SKIP_SINGLE: gl.constexpr, num_warps: gl.constexpr):
    """(sequence, tile within it) of the batch's `tile`-th query tile: `_ragged.batch_block` in Gluon (with
    SKIP_SINGLE one-token sequences have no tile)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs_b = gl.arange(0, BLOCK_B, layout=layout)
    b_mask = offs_b < n_seq
    lens = gl.load(cu_ptr + offs_b + 1, mask=b_mask, other=0) - gl.load(cu_ptr + offs_b, mask=b_mask, other=0)
    blocks = (lens * GROUP + BLOCK_M - 1) // BLOCK_M
    if SKIP_SINGLE:
        blocks = gl.where(lens == 1, 0, blocks)
    ends = gl.associative_scan(blocks, 0, _add)
    seq = gl.reduce((ends <= tile).to(gl.int32), 0, _add)
    return seq, tile - gl.reduce(gl.where(offs_b == seq, ends - blocks, 0), 0, _add)


@gluon.jit
def _softmax_tile(s, m_i, l_i, start, q_pos, qk_scale, keys_layout: gl.constexpr, MASKED: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Online softmax (base 2) of one tile of raw scores -> (P, rescale factor, running max, running sum)."""
    if MASKED:
        keys = start + gl.arange(0, BLOCK_N, layout=keys_layout)
        visible = gl.expand_dims(keys, 0) <= gl.expand_dims(q_pos, 1)
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _max))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: exp2(-inf) = 0
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
    else:
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _max) * qk_scale)
        m_ref = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    alpha = gl.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + gl.reduce(p, 1, _add)


@gluon.jit
def _tile_copies(desc, dst, ready, free, free_phase, bt_row, j, kv_end, kv_col, oob_row, tile_bytes: gl.constexpr,
                 PAGE: gl.constexpr, PAGES: gl.constexpr):
    """Key tile j of K or V into the stage `dst`: once both consumers have freed it, one TMA box a page, all counted
    on `ready`; pages past the last visible key from a row past the tensor (zeros)."""
    mbarrier.wait(free, free_phase)
    mbarrier.expect(ready, tile_bytes)
    for i in gl.static_range(PAGES):
        key = (j * PAGES + i) * PAGE
        row = gl.load(bt_row + j * PAGES + i, mask=key < kv_end, other=0) * PAGE
        row = gl.where(key < kv_end, row, oob_row)
        _tma_load(desc, [row, kv_col], ready, dst.slice(i * PAGE, PAGE))


@gluon.jit
def _producer(k_desc, v_desc, bt_row, kv_end, n_tiles, kv_col, oob_row, k_smem, v_smem, k_ready, v_ready, k_free,
              v_free, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """K_j then V_j for every key tile j, each stage refilled once both consumers have freed it."""
    PAGES: gl.constexpr = BLOCK_N // PAGE
    tile_bytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * 2  # bf16 / fp16
    for j in range(n_tiles):
        stage = j % STAGES
        free_phase = ((j // STAGES) & 1) ^ 1  # the first round finds every stage free
        _tile_copies(k_desc, k_smem.index(stage), k_ready.index(stage), k_free.index(stage), free_phase, bt_row, j,
                     kv_end, kv_col, oob_row, tile_bytes, PAGE, PAGES)
        _tile_copies(v_desc, v_smem.index(stage), v_ready.index(stage), v_free.index(stage), free_phase, bt_row, j,
                     kv_end, kv_col, oob_row, tile_bytes, PAGE, PAGES)


@gluon.jit
def _consumer(q_ptr, o_ptr, q_s0, q_s1, o_s0, o_s1, q_start, q_len, ctx, kvh, mt, qk_scale, kv_end, n_tiles,
              full_tiles, q_smem, k_smem, v_smem, k_ready, v_ready, k_free, v_free, HALF: gl.constexpr,
              PAGE: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Rows `HALF * HALF_M` on of the program's query tile: the online softmax over every key tile. The two
    consumers drift freely (taking turns at the MMAs, FlashAttention-3's ping-pong on mbarriers, measured no faster
    on an H100: docs/benchmarks.md, twenty-sixth session)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    warps: gl.constexpr = gl.num_warps()
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])  # 16-byte accesses a thread
    rows_io: gl.constexpr = gl.SliceLayout(1, io)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    keys_layout: gl.constexpr = gl.SliceLayout(0, mma_s)

    r_io = mt * BLOCK_M + HALF * HALF_M + gl.arange(0, HALF_M, layout=rows_io)
    tok_io = r_io // GROUP
    q_rows = (q_start + tok_io).to(gl.int64) * q_s0 + (kvh * GROUP + r_io % GROUP) * q_s1
    io_mask = gl.expand_dims(tok_io < q_len, 1) & gl.expand_dims(dims >= 0, 0)
    q = gl.load(q_ptr + gl.expand_dims(q_rows, 1) + gl.expand_dims(dims, 0), mask=io_mask, other=0.0)
    if STAGES > 2:
        q_a = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
    else:
        q_smem.store(q)
        fence_async_shared()
        _partition_barrier()
        q_a = q_smem

    r_s = mt * BLOCK_M + HALF * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_s))
    q_pos = ctx - q_len + r_s // GROUP
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, mma_s))
    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, mma_o)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_a, k_smem.index(0).permute((1, 0)), gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_s),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_free.index(0))
        if full_tiles > 0:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, q_pos, qk_scale, keys_layout, False, BLOCK_N)
        else:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, q_pos, qk_scale, keys_layout, True, BLOCK_N)
        p_op = gl.convert_layout(p.to(dtype), p_operand)
        for j in range(1, n_tiles):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
            s = warpgroup_mma(q_a, k_smem.index(stage).permute((1, 0)),
                              gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_s), use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            o = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores; P_{j-1} V_{j-1} still in flight
            mbarrier.arrive(k_free.index(stage))
            if j >= full_tiles:
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, q_pos, qk_scale, keys_layout, True,
                                                   BLOCK_N)
            else:
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, q_pos, qk_scale, keys_layout, False,
                                                   BLOCK_N)
            p_op = gl.convert_layout(p.to(dtype), p_operand)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            mbarrier.arrive(v_free.index(prev))
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, mma_o)), 1)

        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        v_last = v_smem.index(last)
        # The rows of the last visible page past the last visible key: zeros, so that 0 * garbage stays 0 (the
        # pages after it came zero-filled from outside the tensor).
        valid = kv_end - (n_tiles - 1) * BLOCK_N
        if valid % PAGE != 0:
            for pg in gl.static_range(BLOCK_N // PAGE):
                if pg == valid // PAGE:
                    tail = v_last.slice(pg * PAGE, PAGE)
                    v = tail.load(io)
                    keys = pg * PAGE + gl.arange(0, PAGE, layout=rows_io)
                    tail.store(gl.where(gl.expand_dims(keys < valid, 1), v, gl.zeros_like(v)))
            fence_async_shared()
            _partition_barrier()
        o = warpgroup_mma(p_op, v_last, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))
    out = o / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)  # no visible key (padding): zeros, never NaN
    if STAGES > 2:
        out_io = gl.convert_layout(out.to(dtype), io)
    else:  # through this warpgroup's Q buffer (its last reader, the last scores MMA, has retired)
        q_smem.store(out.to(dtype))
        _partition_barrier()
        out_io = q_smem.load(io)
    o_rows = (q_start + tok_io).to(gl.int64) * o_s0 + (kvh * GROUP + r_io % GROUP) * o_s1
    gl.store(o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(dims, 0), out_io, mask=io_mask)


@gluon.jit
def _prefill_kernel(q_ptr, o_ptr, k_desc, v_desc, qsl_ptr, seq_lens_ptr, bt_ptr, q_s0, q_s1, o_s0, o_s1, bt_s0,
                    qk_scale, n_kv_heads, n_seq, oob_row, PAGE: gl.constexpr, GROUP: gl.constexpr,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, SKIP_SINGLE: gl.constexpr,
                    WORKER_REGS_0: gl.constexpr, WORKER_REGS_1: gl.constexpr, USE_PDL: gl.constexpr,
                    num_warps: gl.constexpr):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    if USE_PDL:  # programmatic dependent launch: start early, read the step's q and cache only after the producer ends
        _grid_dependency("griddepcontrol.launch_dependents;")
        _grid_dependency("griddepcontrol.wait;")
    pid = gl.program_id(0)
    kvh = pid % n_kv_heads
    tile = gl.num_programs(0) // n_kv_heads - 1 - pid // n_kv_heads  # longest first, as the Triton kernel
    b, mt = _tile_sequence(qsl_ptr, n_seq, tile, BLOCK_M, BLOCK_B, GROUP, SKIP_SINGLE, num_warps)
    if b >= n_seq:
        return
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    ctx = gl.load(seq_lens_ptr + b)
    # Keys visible to the tile's last token (exclusive), and the key tiles its first token already sees whole.
    first_tok = mt * BLOCK_M // GROUP
    kv_end = ctx - q_len + gl.minimum(q_len, ((mt + 1) * BLOCK_M - 1) // GROUP + 1)
    n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    full_tiles = gl.maximum(ctx - q_len + first_tok + 1, 0) // BLOCK_N

    tiles: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tiles)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tiles)
    if STAGES > 2:
        q_smem = v_smem  # unused: Q in registers
    else:
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], tiles)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=2)  # one arrival a consumer warpgroup
        mbarrier.init(v_free.index(i), count=2)

    bt_row = bt_ptr + b.to(gl.int64) * bt_s0
    gl.warp_specialize([
        (_consumer, (q_ptr, o_ptr, q_s0, q_s1, o_s0, o_s1, q_start, q_len, ctx, kvh, mt, qk_scale, kv_end, n_tiles,
                     full_tiles, q_smem.index(0), k_smem, v_smem, k_ready, v_ready, k_free, v_free, 0, PAGE,
                     GROUP, HEAD_DIM, BLOCK_M, HALF_M, BLOCK_N, STAGES)),
        (_consumer, (q_ptr, o_ptr, q_s0, q_s1, o_s0, o_s1, q_start, q_len, ctx, kvh, mt, qk_scale, kv_end, n_tiles,
                     full_tiles, q_smem.index(1), k_smem, v_smem, k_ready, v_ready, k_free, v_free, 1, PAGE,
                     GROUP, HEAD_DIM, BLOCK_M, HALF_M, BLOCK_N, STAGES)),
        (_producer, (k_desc, v_desc, bt_row, kv_end, n_tiles, kvh * HEAD_DIM, oob_row, k_smem, v_smem, k_ready,
                     v_ready, k_free, v_free, PAGE, BLOCK_N, STAGES)),
    ], [num_warps, 1], [WORKER_REGS_0, WORKER_REGS_1])


def _cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache `[num_blocks, page, Hkv, D]` as `[num_blocks * page, Hkv * D]` (pages of contiguous rows)."""
    num_blocks, page, heads, dim = cache.shape
    return cache.as_strided((num_blocks * page, heads * dim), (heads * dim, 1))


def _shared_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@functools.lru_cache(maxsize=8)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def operands_fit(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The operands' side of `supported`: bf16 / fp16, head_dim 128 in q and the cache, pages that divide the key
    tile and hold contiguous `[page, Hkv, head_dim]` rows (one TMA box a page)."""
    _, page, heads, dim = k_cache.shape
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype and q.shape[-1] == HEAD_DIM
            and dim == HEAD_DIM and BLOCK_N % page == 0
            and k_cache.stride() == (page * heads * dim, heads * dim, dim, 1))


def serves(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int) -> bool:
    """Whether this launch takes this kernel (else the Triton kernel): on, a query longer than `ABOVE`, and
    `supported` operands."""
    return ENABLED and max_query_len > ABOVE and supported(q, k_cache)


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel can serve these operands: `operands_fit` on an sm_90 GPU. Asked at every launch: shape
    checks and a cached capability."""
    return (q.is_cuda and not interpreting() and operands_fit(q, k_cache)
            and _is_sm90(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, qk_scale: float,
           skip_single_token: bool, max_chunk_seqs: int | None = None) -> None:
    """The kernel over operands `attention_prefill.paged_attention_prefill` has checked (see `supported`);
    `qk_scale` is the softmax scale times log2(e), as the Triton kernel takes it."""
    n_tok, num_q_heads, _ = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    check_last_dim_contiguous("out", out)
    n_seq = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    layout = _shared_layout()
    k_desc = TensorDescriptor.from_tensor(_cache_rows(k_cache), [page, HEAD_DIM], layout)
    v_desc = TensorDescriptor.from_tensor(_cache_rows(v_cache), [page, HEAD_DIM], layout)
    grid = (grid_tiles(n_tok * group, BLOCK_M, n_seq, skip_single_token, max_chunk_seqs) * num_kv_heads,)
    _prefill_kernel[grid](
        q, out, k_desc, v_desc, query_start_loc, seq_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        qk_scale, num_kv_heads, n_seq, num_blocks * page,
        PAGE=page, GROUP=group, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HALF_M=HALF_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        BLOCK_B=ragged_block_b(n_seq), SKIP_SINGLE=skip_single_token, WORKER_REGS_0=WORKER_REGS[0],
        WORKER_REGS_1=WORKER_REGS[1], num_warps=CONSUMER_WARPS,
        **(pdl_launch(q.device) if PDL else {"USE_PDL": False}),
    )


def compile_sm90(group: int = 4, page: int = 16, skip_single: bool = False,
                 stages: int | None = None, use_pdl: bool = True):  # noqa: ANN201 - a CompiledKernel
    """The kernel compiled for sm_90 without a GPU (tests check that it builds and how it synchronises)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = _prefill_kernel
    rows = torch.empty((4 * page, 8 * HEAD_DIM), dtype=torch.bfloat16)
    desc = mangle_type(TensorDescriptor.from_tensor(rows, [page, HEAD_DIM], _shared_layout()))
    types = dict.fromkeys(("q_ptr", "o_ptr"), "*bf16") | {"k_desc": desc, "v_desc": desc}
    types |= dict.fromkeys(("qsl_ptr", "seq_lens_ptr", "bt_ptr"), "*i32")
    types |= dict.fromkeys(("q_s0", "q_s1", "o_s0", "o_s1", "bt_s0", "n_kv_heads", "n_seq", "oob_row"), "i32")
    types |= {"qk_scale": "fp32"}
    constexprs = {"PAGE": page, "GROUP": group, "HEAD_DIM": HEAD_DIM, "BLOCK_M": BLOCK_M, "HALF_M": HALF_M,
                  "BLOCK_N": BLOCK_N, "STAGES": stages or STAGES, "BLOCK_B": ragged_block_b(1), "SKIP_SINGLE": skip_single,
                  "WORKER_REGS_0": WORKER_REGS[0], "WORKER_REGS_1": WORKER_REGS[1], "USE_PDL": use_pdl,
                  "num_warps": CONSUMER_WARPS}
    divisible = ("q_ptr", "o_ptr", "qsl_ptr", "seq_lens_ptr", "bt_ptr", "q_s0", "q_s1", "o_s0", "o_s1")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    source = GluonASTSource(fn, types | {name: "constexpr" for name in constexprs}, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": CONSUMER_WARPS})
