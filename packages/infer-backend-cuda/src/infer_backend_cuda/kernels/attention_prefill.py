"""Paged attention for prefill / extend: a ragged (varlen) batch of query chunks, each attending causally
to its sequence's whole paged context, cached prefix pages included.

Sequence `b` owns query rows `query_start_loc[b]:query_start_loc[b+1]` (`q_len` rows) and has context
length `ctx = seq_lens[b]` after this step; its query rows are the LAST `q_len` positions of that context,
so row `i` sits at absolute position `ctx - q_len + i` and sees keys `0..ctx - q_len + i`. Keys and values
are read from the paged cache through `block_tables[b]` (the new tokens must already be stored there).

Grid `((cdiv(T * group, BLOCK_M) + B) * Hkv,)`, flattened over the ragged batch: the programs of query tile t
(one per KV head) take the t-th query tile of the whole batch counted from its end (sequence b has
`cdiv(q_len_b * group, BLOCK_M)` tiles; each program finds its sequence from a prefix sum of those counts over
`query_start_loc`, in registers), so the grid is bounded by the step's tokens, not by `B x max_query_len`: a
captured mixed graph of 256 sequences padded to a 2,048-token bucket launches ~3k programs instead of ~131k of
which 98% would exit at once. One program = one query tile of one KV head of one sequence, whose BLOCK_M rows
are (token, query head) pairs of that KV head's `group` query heads (GQA packing: row r is token r // group,
head kvh * group + r % group), so each K/V tile is read once for the whole group. A one-token sequence would
fill only `group` rows of its tile yet pay the whole tile's tensor-core work for each of its K/V tiles (at
BLOCK_M 128, GQA 4: 97% wasted), so in a mixed step (`skip_single_token`) its programs return at once and the
split-KV decode kernel runs it; its tiles still count in the prefix sum, so the other sequences' tiles are
where they were. FlashAttention-2 style online softmax in fp32
(base 2) over BLOCK_N-key tiles, in two loops: the key tiles that the tile's first token already sees run
unmasked, only the last one or two (the diagonal) apply the causal mask. The K/V tiles are gathered row by row
through the block table, so any `block_size` works (a compile-time constant: one per engine). Tiles past
`q_len` return at once. A query row with an empty context (padding: `seq_lens = 0`) gets zeros, never NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import attention_prefill_ws
from infer_backend_cuda.kernels._common import (
    check_last_dim_contiguous,
    dot_in_fp32,
    interpreting,
    next_pow2,
    pdl_launch,
)
from infer_backend_cuda.kernels._ragged import STEP_SIZE_ARGS, batch_block, grid_tiles, ragged_block_b

LOG2_E = 1.4426950408889634  # folded into the score scale: exp(x) = exp2(x * log2(e))
# K/V offsets into a cache view of at most this many elements stay 32-bit: one multiply per key row in the
# inner loop, no widening (a per-layer view of 2^31 bf16 elements is 4 GiB; larger ones take 64-bit offsets).
OFF32_MAX_ELEMENTS = 2**31 - 1


@triton.jit
def _kv_tile(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bt_row,
    start,
    kv_end,
    q_pos,
    offs_d,
    kv_s0,
    kv_s1,
    qk_scale,
    PAGE: tl.constexpr,
    OFF64: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One BLOCK_N-key step of the online softmax. Without CAUSAL_MASK every key of the tile is visible to
    every row (the tile lies wholly before the query tile's first token), so the bounds and causal compares,
    the `-inf` guard and the masked loads are all left out: that is every step but the last one or two.
    K and V share their strides, so one offset per key row serves both."""
    offs_n = start + tl.arange(0, BLOCK_N)
    kv_mask = offs_d[None, :] < HEAD_DIM
    if CAUSAL_MASK:
        n_mask = offs_n < kv_end
        kv_mask = kv_mask & n_mask[:, None]
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0)
    else:
        page = tl.load(bt_row + offs_n // PAGE)
    if OFF64:
        page = page.to(tl.int64)
    kv_off = (page * kv_s0 + (offs_n % PAGE) * kv_s1)[:, None] + offs_d[None, :]
    if CAUSAL_MASK or BLOCK_D != HEAD_DIM:
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_base + kv_off)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    # Scores stay in the log2 domain (log2(e) is folded into qk_scale), so one exp2 per element.
    if CAUSAL_MASK:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: exp2(-inf) = 0
        p = tl.exp2(s - m_ref[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_ref = m_new
        p = tl.exp2(s * qk_scale - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if CAUSAL_MASK or BLOCK_D != HEAD_DIM:
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_base + kv_off)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=STEP_SIZE_ARGS)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    q_s0,
    q_s1,
    o_s0,
    o_s1,
    kv_s0,
    kv_s1,
    kv_s2,
    bt_s0,
    qk_scale,
    n_kv_heads,
    n_seq,
    PAGE: tl.constexpr,
    OFF64: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Longest first: the blocks are scheduled in program order, so the batch's last tiles (a sequence's last
    # tiles see the most keys) start first and the short ones fill the tail, instead of the causal triangle's
    # longest tiles starting last and running alone. The KV heads of one tile are neighbours.
    pid = tl.program_id(0)
    kvh = pid % n_kv_heads
    tile = tl.num_programs(0) // n_kv_heads - 1 - pid // n_kv_heads
    # A one-token sequence is the decode kernel's in a mixed step (SKIP_SINGLE): it has no tile here.
    b, mt = batch_block(qsl_ptr, n_seq, tile, BLOCK_M, BLOCK_B, GROUP, SKIP_SINGLE)
    if b >= n_seq:
        return  # past the batch's last tile (the grid is an upper bound)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = offs_r // GROUP  # the row's token within the sequence's query chunk
    heads = kvh * GROUP + offs_r % GROUP  # the row's query head
    m_mask = offs_m < q_len
    q_pos = ctx - q_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    rows = q_start + offs_m.to(tl.int64)
    q_off = rows[:, None] * q_s0 + heads[:, None] * q_s1 + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_tok = mt * BLOCK_M // GROUP
    # Keys visible to the tile's last token (exclusive bound), and the whole BLOCK_N tiles of keys that its
    # first token already sees (so every row does): those run without the causal mask.
    kv_end = ctx - q_len + tl.minimum(q_len, ((mt + 1) * BLOCK_M - 1) // GROUP + 1)
    full_end = tl.maximum(ctx - q_len + first_tok + 1, 0) // BLOCK_N * BLOCK_N
    bt_row = bt_ptr + b.to(tl.int64) * bt_s0
    k_base = k_cache_ptr + kvh * kv_s2
    v_base = v_cache_ptr + kvh * kv_s2
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, kv_end, q_pos, offs_d,
                                 kv_s0, kv_s1, qk_scale, PAGE, OFF64, HEAD_DIM, BLOCK_N, BLOCK_D, False, DOT_F32)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, kv_end, q_pos, offs_d,
                                 kv_s0, kv_s1, qk_scale, PAGE, OFF64, HEAD_DIM, BLOCK_N, BLOCK_D, True, DOT_F32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_off = rows[:, None] * o_s0 + heads[:, None] * o_s1 + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of a launch.
PrefillConfig = tuple[int, int, int, int]


def _prefill_config(head_dim: int, element_size: int) -> PrefillConfig:
    """On Hopper up to head_dim 128: 128-row tiles (two warpgroups of wgmma, so each K/V tile feeds twice the
    rows of a 64-row one; with 4 warps they spill). At head_dim 128 128-key tiles in 2 stages, measured fastest on
    the H200; below it 64-key tiles in 3 stages (not measured against others). head_dim 256 keeps its fp32 accumulator in
    registers without spills at 64 rows x 32 keys. The interpreter runs 16-row tiles (small shapes, many tiles
    per test). fp32 (tests, the CPU-comparison path) takes small tiles: at 4 bytes an element the 128 x 128 tiles'
    staged K/V outgrow the 228 KB of shared memory (the H200 refused them at head_dim 128)."""
    if interpreting():
        return 16, 16, 4, 1
    if element_size > 2:
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 2)
    if head_dim == 128:  # measured on the H200 (bench/attention_prefill.py, docs/benchmarks.md): 128-key tiles of
        return 128, 128, 8, 2  # 2 stages beat 64-key ones of 3 at every chunking of a 16k prompt (389 vs 320 TFLOP/s)
    if head_dim < 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    skip_single_token: bool = False,
    max_chunk_seqs: int | None = None,
) -> torch.Tensor:
    """q `[T, Hq, D]`, caches `[num_blocks, block_size, Hkv, D]`, query_start_loc `[B+1]`, seq_lens `[B]`,
    block_tables `[B, max_blocks]` -> `[T, Hq, D]` in q's dtype. Rows not owned by any sequence are left
    unwritten. `skip_single_token`: the rows of sequences whose query length is 1 are left unwritten too (the decode
    kernel runs them: `paged_attention_decode` with `query_start_loc`). With no `config`, bf16 / fp16 at head_dim 128
    on sm_90 run the warp-specialised Gluon kernel (`attention_prefill_ws.py`; INFER_CUDA_WS_PREFILL=0 for A/B runs)
    where `max_query_len` is over INFER_CUDA_WS_PREFILL_ABOVE (256); `config` names a tile of this module's Triton
    kernel (tests, benchmarks). `max_chunk_seqs` (with `skip_single_token`): at most this many sequences have two
    query rows or more, which bounds the grid (`grid_tiles`); a captured mixed graph of a few prompt chunks beside
    many decodes then launches a few dozen programs, not one a sequence."""
    n_tok, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match head_dim {head_dim}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache's {v_cache.stride()}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty((n_tok, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    n_seq = seq_lens.shape[0]
    if n_tok == 0 or n_seq == 0 or max_query_len <= 0:
        return out
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if config is None and attention_prefill_ws.serves(q, k_cache, max_query_len):
        attention_prefill_ws.launch(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
                                    float(scale) * LOG2_E, skip_single_token, max_chunk_seqs)
        return out
    bm, bn, num_warps, num_stages = config or _prefill_config(head_dim, q.element_size())
    group = num_q_heads // num_kv_heads
    grid = (grid_tiles(n_tok * group, bm, n_seq, skip_single_token, max_chunk_seqs) * num_kv_heads,)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        float(scale) * LOG2_E,
        num_kv_heads,
        n_seq,
        PAGE=block_size,
        OFF64=k_cache.shape[0] * k_cache.stride(0) > OFF32_MAX_ELEMENTS,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_F32=dot_in_fp32(q.dtype),
        BLOCK_B=ragged_block_b(n_seq),
        SKIP_SINGLE=skip_single_token,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q.device),
    )
    return out
