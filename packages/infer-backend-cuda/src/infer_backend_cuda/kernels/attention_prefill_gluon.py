"""Paged prefill attention for Hopper in Gluon: the value MMA of key tile j - 1 runs on the tensor cores while the
softmax of tile j runs on the CUDA cores (FlashAttention-3's intra-warpgroup overlap).

The same contract as `attention_prefill.paged_attention_prefill` (ragged query chunks attending causally to their
sequence's paged context, GQA rows packed `(token, query head)`, the flattened longest-first grid, single-token
sequences skipped in mixed steps); see that module for the row packing and the masks. What differs is the loop:

    S_j = Q K_j^T              (wgmma, async)
    O  += P_{j-1} V_{j-1}      (wgmma, async, P from registers)
    wait until one group is in flight: S_j is ready, P_{j-1} V_{j-1} still runs
    softmax of S_j -> P_j, the rescale factor
    wait for P_{j-1} V_{j-1}; O *= the rescale factor

Triton's pipeliner waits for every scores MMA at once before the softmax that reads it (`warp_group_dot_wait
{pendings = 0}`; the twenty-third session's sm_90 compile), so there the tensor cores idle during each tile's
softmax; here Gluon's explicit `warpgroup_mma_wait(num_outstanding=1)` keeps the value MMA in flight across it.

Keys and values are gathered from the 16-token pages by `cp.async` (TMA cannot gather rows on Hopper), all 8 warps
sharing the copies, into a ring of STAGES tiles each for K and V: the copies issued in iteration j right after its
MMAs (K_{j+STAGES-1} and V_{j+STAGES-2}, their page ids read an iteration earlier) have STAGES - 1 iterations to
land, and one CTA barrier an iteration both publishes them and frees the stages the previous iteration read. 128
query rows (two warpgroups of 64) by 128 keys by head_dim 128: Q and two stages fill 160 KB of shared memory, one
program an SM.

Only head_dim 128 in bf16 / fp16 on sm_90 (`supported`); everything else runs the Triton kernel.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from infer_backend_cuda.kernels._common import check_last_dim_contiguous, interpreting
from infer_backend_cuda.kernels._ragged import ragged_block_b

# Names that moved between Triton 3.6 (the device image) and 3.9 (this workspace).
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

HEAD_DIM = 128
BLOCK_M = 128  # (token, query head) rows: two warpgroups of 64
# Keys a tile: 128 (the scores tile as wide as the head); INFER_CUDA_GLUON_PREFILL_KEYS=64 for A/B runs (half the
# score registers, twice the iterations).
BLOCK_N = int(os.environ.get("INFER_CUDA_GLUON_PREFILL_KEYS", "128"))
# K and V tiles in flight (each a ring of STAGES): a tile's copies are issued STAGES - 1 iterations before its MMA.
# INFER_CUDA_GLUON_PREFILL_STAGES for A/B runs; at 128 keys three stages fill 224 of the 227 KB of shared memory.
STAGES = int(os.environ.get("INFER_CUDA_GLUON_PREFILL_STAGES", "2"))
NUM_WARPS = 8
if BLOCK_N not in (64, 128) or not 2 <= STAGES <= (3 if BLOCK_N == 128 else 4):
    raise ValueError(f"INFER_CUDA_GLUON_PREFILL_KEYS={BLOCK_N} / _STAGES={STAGES}: keys 128 take 2-3 stages, keys 64 "
                     "take 2-4 (shared memory)")
# INFER_CUDA_GLUON_PREFILL=1 serves prefill attention with this kernel where it can (A/B runs); off by default: on the
# H100 it measured 5-10 % below the Triton kernel (docs/benchmarks.md, twenty-fourth session). Read once at import.
ENABLED_ENV = "INFER_CUDA_GLUON_PREFILL"
ENABLED = os.environ.get(ENABLED_ENV, "0").strip() == "1"


# Reductions through gl.reduce with Gluon combine functions: gl.sum / gl.max wrap triton.language's, which are
# interpreter functions when TRITON_INTERPRET=1 (the CPU test run) and then do not compile for sm_90.
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _tile_sequence(cu_ptr, n_seq, tile, BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, GROUP: gl.constexpr,
                   num_warps: gl.constexpr):
    """(sequence, tile within it) of the batch's `tile`-th query tile: `_ragged.batch_block` in Gluon."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs_b = gl.arange(0, BLOCK_B, layout=layout)
    b_mask = offs_b < n_seq
    lens = gl.load(cu_ptr + offs_b + 1, mask=b_mask, other=0) - gl.load(cu_ptr + offs_b, mask=b_mask, other=0)
    blocks = (lens * GROUP + BLOCK_M - 1) // BLOCK_M
    ends = gl.associative_scan(blocks, 0, _add)
    seq = gl.reduce((ends <= tile).to(gl.int32), 0, _add)
    return seq, tile - gl.reduce(gl.where(offs_b == seq, ends - blocks, 0), 0, _add)


@gluon.jit
def _kv_rows(bt_row, start, kv_end, keys, kv_s0, kv_s1, kv_head, PAGE: gl.constexpr):
    """Offsets of keys `start + keys` of one KV head in the paged cache, and which of them exist."""
    pos = start + keys
    ok = pos < kv_end
    page = gl.load(bt_row + pos // PAGE, mask=ok, other=0)
    return page.to(gl.int64) * kv_s0 + (pos % PAGE) * kv_s1 + kv_head, ok


@gluon.jit
def _copy_rows(dst, base, rows, ok, dims):
    """cp.async of `rows` (offsets) x `dims` into `dst`; rows not `ok` are zero-filled."""
    ptrs = base + gl.expand_dims(rows, 1) + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(ok, 1) & gl.expand_dims(dims >= 0, 0)
    _cp_async(dst, ptrs, mask=mask)


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
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
                    q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, kv_s2, bt_s0, qk_scale, n_kv_heads, n_seq,
                    PAGE: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BLOCK_B: gl.constexpr, SKIP_SINGLE: gl.constexpr,
                    num_warps: gl.constexpr):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    pid = gl.program_id(0)
    kvh = pid % n_kv_heads
    tile = gl.num_programs(0) // n_kv_heads - 1 - pid // n_kv_heads  # longest first, as the Triton kernel
    b, mt = _tile_sequence(qsl_ptr, n_seq, tile, BLOCK_M, BLOCK_B, GROUP, num_warps)
    if b >= n_seq:
        return
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    ctx = gl.load(seq_lens_ptr + b)
    if SKIP_SINGLE:
        if q_len == 1:
            return

    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte copies a thread
    tiles: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    rows_io: gl.constexpr = gl.SliceLayout(1, io)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))

    # Q: rows (token, head) of this KV head's GROUP query heads, into shared memory (the scores MMA's A).
    r_io = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_io)
    tok_io = r_io // GROUP
    q_rows = (q_start + tok_io).to(gl.int64) * q_s0 + (kvh * GROUP + r_io % GROUP) * q_s1
    row_ok = tok_io < q_len
    io_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(dims >= 0, 0)
    q = gl.load(q_ptr + gl.expand_dims(q_rows, 1) + gl.expand_dims(dims, 0), mask=io_mask, other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], tiles, q)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tiles)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tiles)

    # Keys visible to the tile's last token (exclusive), and the key tiles its first token already sees whole.
    first_tok = mt * BLOCK_M // GROUP
    kv_end = ctx - q_len + gl.minimum(q_len, ((mt + 1) * BLOCK_M - 1) // GROUP + 1)
    n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    full_tiles = gl.maximum(ctx - q_len + first_tok + 1, 0) // BLOCK_N
    r_s = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
    q_pos = ctx - q_len + r_s // GROUP
    keys_layout: gl.constexpr = gl.SliceLayout(0, mma_s)

    bt_row = bt_ptr + b.to(gl.int64) * bt_s0
    kv_head = kvh * kv_s2
    keys = gl.arange(0, BLOCK_N, layout=rows_io)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, mma_s))
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_o)
    if n_tiles > 0:
        # Prologue: copy group t holds K_t and V_{t-1} (group 0 K_0 alone, so that tile 0's scores wait for it only).
        rows_v, ok_v = _kv_rows(bt_row, 0, kv_end, keys, kv_s0, kv_s1, kv_head, PAGE)
        _copy_rows(k_smem.index(0), k_cache_ptr, rows_v, ok_v, dims)
        async_copy.commit_group()
        for t in gl.static_range(1, STAGES):
            rows_k, ok_k = _kv_rows(bt_row, t * BLOCK_N, kv_end, keys, kv_s0, kv_s1, kv_head, PAGE)
            _copy_rows(k_smem.index(t), k_cache_ptr, rows_k, ok_k, dims)
            _copy_rows(v_smem.index(t - 1), v_cache_ptr, rows_v, ok_v, dims)
            async_copy.commit_group()
            rows_v, ok_v = rows_k, ok_k
        rows_k, ok_k = _kv_rows(bt_row, STAGES * BLOCK_N, kv_end, keys, kv_s0, kv_s1, kv_head, PAGE)
        async_copy.wait_group(STAGES - 1)
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if full_tiles > 0:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, q_pos, qk_scale, keys_layout, False, BLOCK_N)
        else:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, q_pos, qk_scale, keys_layout, True, BLOCK_N)
        p_op = gl.convert_layout(p.to(dtype), p_operand)

        for j in range(1, n_tiles):
            # Group j (K_j, V_{j-1}) landed; every warp is past iteration j - 1, so the stages of K_{j-1} and V_{j-2}
            # are free for group j + STAGES - 1.
            async_copy.wait_group(STAGES - 2)
            fence_async_shared()
            _cta_barrier()
            s = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s), use_acc=False, is_async=True)
            o = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), o, is_async=True)
            # Under the MMAs: the copies of group j + STAGES - 1, whose page ids were read an iteration ago (a load's
            # latency here would delay the copies), and the page ids of the group after it.
            _copy_rows(k_smem.index((j + STAGES - 1) % STAGES), k_cache_ptr, rows_k, ok_k, dims)
            _copy_rows(v_smem.index((j + STAGES - 2) % STAGES), v_cache_ptr, rows_v, ok_v, dims)
            async_copy.commit_group()
            rows_v, ok_v = rows_k, ok_k
            rows_k, ok_k = _kv_rows(bt_row, (j + STAGES) * BLOCK_N, kv_end, keys, kv_s0, kv_s1, kv_head, PAGE)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores; P_{j-1} V_{j-1} still in flight
            if j >= full_tiles:
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, q_pos, qk_scale, keys_layout, True,
                                                   BLOCK_N)
            else:
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, q_pos, qk_scale, keys_layout, False,
                                                   BLOCK_N)
            p_op = gl.convert_layout(p.to(dtype), p_operand)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, mma_o)), 1)

        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        o = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))
    out = o / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)  # no visible key (padding): zeros, never NaN
    # Through Q's shared memory (its last reader, the last scores MMA, has retired) for 16-byte stores.
    q_smem.store(out.to(dtype))
    _cta_barrier()
    out_io = q_smem.load(io)
    o_rows = (q_start + tok_io).to(gl.int64) * o_s0 + (kvh * GROUP + r_io % GROUP) * o_s1
    gl.store(o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(dims, 0), out_io, mask=io_mask)


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel can serve these operands: sm_90, head_dim 128, bf16 / fp16 (else the Triton kernel)."""
    return (q.is_cuda and not interpreting() and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == q.dtype and q.shape[-1] == HEAD_DIM
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, qk_scale: float,
           skip_single_token: bool) -> None:
    """The kernel over operands `attention_prefill.paged_attention_prefill` has checked (see `supported`);
    `qk_scale` is the softmax scale times log2(e), as the Triton kernel takes it."""
    n_tok, num_q_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_last_dim_contiguous("out", out)
    n_seq = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    grid = ((triton.cdiv(n_tok * group, BLOCK_M) + n_seq) * num_kv_heads,)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        qk_scale, num_kv_heads, n_seq,
        PAGE=block_size, GROUP=group, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        BLOCK_B=ragged_block_b(n_seq), SKIP_SINGLE=skip_single_token, num_warps=NUM_WARPS,
    )


def compile_sm90(group: int = 4, page: int = 16, skip_single: bool = False, block_n: int | None = None,
                 stages: int | None = None):  # noqa: ANN201 - a CompiledKernel
    """The kernel compiled for sm_90 without a GPU, at the module's key tile and stages unless named (tests check
    that it builds, its shared memory and the wait that keeps the value MMA in flight)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _prefill_kernel
    pointers = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "o_ptr", "qsl_ptr", "seq_lens_ptr", "bt_ptr")
    types = dict.fromkeys(("q_ptr", "k_cache_ptr", "v_cache_ptr", "o_ptr"), "*bf16")
    types |= dict.fromkeys(("qsl_ptr", "seq_lens_ptr", "bt_ptr"), "*i32")
    types |= dict.fromkeys(("q_s0", "q_s1", "o_s0", "o_s1", "kv_s0", "kv_s1", "kv_s2", "bt_s0"), "i32")
    types |= {"qk_scale": "fp32", "n_kv_heads": "i32", "n_seq": "i32"}
    constexprs = {"PAGE": page, "GROUP": group, "HEAD_DIM": HEAD_DIM, "BLOCK_M": BLOCK_M, "BLOCK_N": block_n or BLOCK_N,
                  "STAGES": stages or STAGES, "BLOCK_B": ragged_block_b(1), "SKIP_SINGLE": skip_single, "num_warps": NUM_WARPS}
    # Launched with 16-divisible pointers and strides (the cache and q strides are multiples of head_dim).
    divisible = pointers + ("q_s0", "q_s1", "o_s0", "o_s1", "kv_s0", "kv_s1", "kv_s2")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    source = GluonASTSource(fn, types | {name: "constexpr" for name in constexprs}, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
