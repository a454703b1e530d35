"""Paged attention for decode: one new query token per sequence, split-KV with GQA head grouping.

Pass 1, grid `(B, Hkv, num_splits)`: a program takes ONE KV head of one sequence and ALL `group = Hq/Hkv`
query heads that read it (padded to a 16-row tile for `tl.dot`), so every K/V byte of the context is read
once per KV head, not once per query head. The context `seq_lens[b]` is cut into `num_splits` chunks
(multiples of BLOCK_N, computed in-kernel from the device-side length); each program runs an fp32 online
softmax over its chunk and writes the normalised partial output and its log-sum-exp.
Pass 2, grid `(B, Hq)`: merges the splits with their LSE weights. Empty splits carry LSE = -inf and weigh
nothing; a padding row (`seq_lens = 0`) gets zeros. With one split (from 33 sequences at 8 KV heads on 132 SMs:
every decode batch of a busy server) pass 1 writes its normalised output to the query row itself and pass 2 is not
launched: no fp32 round trip and one launch fewer a layer.

`num_splits` is a launch-time constant chosen from (batch, Hkv, SM count) only, never from the per-step
context lengths, so a CUDA graph captured once stays correct (and well balanced) for any lengths.

Ragged (mixed-step) mode, with `query_start_loc`: q and out are a ragged batch's `[T, Hq, D]`; sequence b's
query row is `query_start_loc[b]`, and both passes' programs of a sequence whose query length is not 1 return
at once (the prefill kernel, told `skip_single_token`, computes those rows). The split workspace is indexed by
sequence, so a skipped sequence's slots are neither written nor read. Which sequences run is read on the
device: a captured mixed graph serves any mix of prefill chunks and one-token rows.

Two fusions, each saving a launch a layer in the decode step (`DecodeRope`, `merge_in_kernel`; both on by default,
`INFER_CUDA_FUSED_DECODE_ATTENTION` = 0 / rope / merge chooses for A/B runs):
- The q/k norm, RoPE and KV store before the attention (`qk_norm_rope.py`'s work) run in pass 1: every program
  norms and rotates its group's q rows from the raw projection (a few KB from L2), and the program whose split
  holds the new token's position norms, rotates and stores that token's k and v, then synchronises its threads
  (stores before a CTA barrier are visible to the CTA's later loads) before its key loop reads them back; no
  other program reads that position.
- The split merge runs in pass 1 too: only the splits that hold keys take part (the first `cdiv(L_b, chunk)`, the
  others return at once); when that is one split it writes the output itself; else each stores its partial and
  counts its arrival on a per-(sequence, KV head) counter (the split-K fix-up's counters and memory order,
  `split_k.last_arrival`), and the last one merges its group's heads (all partials loaded as one tile before any store)
  and resets the counter.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import split_k
from infer_backend_cuda.kernels.activation import sigmoid_gated
from infer_backend_cuda.kernels._common import (
    check_last_dim_contiguous,
    dot_in_fp32,
    interpreting,
    next_pow2,
    pdl_launch,
)

MAX_SPLITS = 32
# The split count follows the batch size (`choose_num_splits`). Unspecialised, it compiles no variant of its
# own, so a mixed step, whose batch sizes are not those of the captured decode graphs and may run eagerly,
# meets no compile in the middle of serving (with the reduce pass's SPLITS_PAD fixed in ragged mode).
SPLIT_ARGS = ("num_splits", "ml_s0", "ml_s1")  # the LSE workspace's strides are multiples of it
# INFER_CUDA_FUSED_DECODE_ATTENTION: which of the two fusions run (A/B runs): 1 both, 0 neither (the q/k norm +
# RoPE + store and the split merge as launches of their own), "merge" or "rope" one. Read once at import, like the
# other INFER_CUDA_ switches.
FUSED_ENV = "INFER_CUDA_FUSED_DECODE_ATTENTION"
_FUSED = os.environ.get(FUSED_ENV, "1").strip().lower()
FUSED_ROPE = _FUSED in ("1", "rope")
FUSED_MERGE = _FUSED in ("1", "merge")
# INFER_CUDA_DECODE_SPLIT_WAVES: how many waves of (sequence, KV head, split) programs over the SMs the split count
# aims at (`choose_num_splits`; A/B runs at large batches, where one split per sequence is a long serial walk).
SPLIT_WAVES_ENV = "INFER_CUDA_DECODE_SPLIT_WAVES"
SPLIT_WAVES = max(1, int(os.environ.get(SPLIT_WAVES_ENV, "2")))
# INFER_CUDA_DECODE_TILE: "BLOCK_N:WARPS:STAGES" of the key loop at head_dim <= 128 instead of 64:4:2 (in-model A/B
# runs of the configs that `bench_decode_splits.py --configs` found faster in the plain kernel at some shapes).
TILE_ENV = "INFER_CUDA_DECODE_TILE"


def _tile_override() -> tuple[int, int, int] | None:
    raw = os.environ.get(TILE_ENV, "").strip()
    if not raw:
        return None
    try:
        block_n, warps, stages = (int(x) for x in raw.split(":"))
    except ValueError:
        raise ValueError(f"{TILE_ENV}={raw!r}: expected BLOCK_N:WARPS:STAGES, e.g. 32:4:2") from None
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8) or stages < 1:
        raise ValueError(f"{TILE_ENV}={raw!r}: BLOCK_N a power of two >= 16, WARPS 1/2/4/8, STAGES >= 1")
    return block_n, warps, stages


TILE = _tile_override()
# INFER_CUDA_DECODE_HEADS_FASTEST (default 1): the split pass's grid `(Hkv, B, splits)`, so a sequence's Hkv programs
# launch together and the sequences start in batch order; 0: `(B, Hkv, splits)` (A/B runs). A served batch holds its
# sequences in admission order, the oldest (which has generated the most) first, so this starts the longest first:
# with the sequences fastest, the longest sequences' last heads started in the second wave and set the kernel's tail.
# Twenty-ninth session, H100, served form, contexts 650 down to 140: 96 rows 61.2 against 69.4 us, 128 rows 78.5
# against 85.8 (floors 51.3 / 68.3); uniform contexts unchanged; chat at qps 32 ITL p50 6.41 against 6.93 ms.
HEADS_FASTEST_ENV = "INFER_CUDA_DECODE_HEADS_FASTEST"
HEADS_FASTEST = os.environ.get(HEADS_FASTEST_ENV, "1").strip() != "0"


class DecodeRope(NamedTuple):
    """What `qk_norm_rope_store` takes besides q and the caches, for pass 1 to do its work: q is then the raw
    projection's q `[B, Hq, D]` (any row and head strides), k / v `[B, Hkv, D]` likewise, the rotation row of
    sequence b's token `cos_sin_cache[positions[b]]` (`[max_pos, R]`, `R <= D`: partial rotary), the token stored
    at `slot_mapping[b]` (-1: nothing)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor


@triton.jit
def _query_row(qsl_ptr, b, RAGGED: tl.constexpr):
    """Sequence b's query row: b itself in a decode batch; in a ragged batch its one row
    `query_start_loc[b]`, or -1 when its query length is not 1 (a prefill chunk, an empty padding sequence)."""
    if RAGGED:
        start = tl.load(qsl_ptr + b).to(tl.int64)
        one = (tl.load(qsl_ptr + b + 1).to(tl.int64) - start) == 1
        return tl.where(one, start, -1)
    else:
        return b


@triton.jit
def _partner(HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each dim's NeoX rotation partner (`d +- HALF` within the rotary dims, itself past them) and the rotary mask."""
    offs_d = tl.arange(0, BLOCK_D)
    rotary = offs_d < 2 * HALF
    return tl.where(offs_d < HALF, offs_d + HALF, tl.where(rotary, offs_d - HALF, offs_d)), rotary


@triton.jit
def _rope_factors(cs_row_ptr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """`(cos, signed sin)` `[BLOCK_D]` fp32 of the rotary row `cs_row_ptr` (`[cos | sin]`): `x cos + x_partner sin`
    rotates (1 and 0 past the rotary dims)."""
    offs_d = tl.arange(0, BLOCK_D)
    rotary = offs_d < 2 * HALF
    half_d = offs_d % HALF
    cos = tl.load(cs_row_ptr + half_d, mask=rotary, other=1.0).to(tl.float32)
    sin = tl.load(cs_row_ptr + HALF + half_d, mask=rotary, other=0.0).to(tl.float32)
    return cos, tl.where(offs_d < HALF, -sin, sin)  # x1 cos - x2 sin | x2 cos + x1 sin


@triton.jit
def _norm_weights(w_ptr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """The q or k norm's weight `[BLOCK_D]` fp32 and the same at each dim's rotation partner (ones without a norm)."""
    offs_d = tl.arange(0, BLOCK_D)
    partner, _ = _partner(HALF, BLOCK_D)
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
        wp = tl.full([BLOCK_D], 1.0, tl.float32)
    return w, wp


@triton.jit
def _norm_rope_rows(src_ptr, row_stride, n_rows, w, wp, cos, sin, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """`n_rows` head rows of one token `[ROWS, BLOCK_D]`, RMS-normed (optional, weights `w` / `wp` from
    `_norm_weights`; rounded to the input dtype, as `qk_norm_rope.py` rounds) and NeoX-rotated in their first
    `2 HALF` dims by `_rope_factors`' cos / sin, returned in fp32. Each dim's rotation partner is loaded as a second
    tile, so the result has the attention's `[rows, D]` layout with no register shuffle."""
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    partner, rotary = _partner(HALF, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = (offs_r < n_rows)[:, None] & d_mask[None, :]
    rows = src_ptr + offs_r[:, None] * row_stride
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0)
    dt = x.dtype
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        x = (x * rstd[:, None] * w[None, :]).to(dt).to(tl.float32)
        xp = (xp * rstd[:, None] * wp[None, :]).to(dt).to(tl.float32)
    return tl.where(rotary[None, :], x * cos[None, :] + xp * sin[None, :], x)


@triton.jit
def _rope_and_store_token(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, rope, slot, row, kvh, owner, q_s0, q_s1, k_s0,
                          k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, block_size, eps,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_D: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr):
    """Pass 1's share of `qk_norm_rope_store` for the token of query row `row` and KV head `kvh`, with `rope` =
    (cos, sin, q norm weights, their partners', k's) and the token's cache `slot` loaded before (the kernel loads
    them before it waits on its producer): returns the group's normed, rotated q rows (in q's dtype, as that kernel
    stores them); the `owner` program also stores the token's rotated k and its v at `slot` and every program then
    waits at a CTA barrier, after which the owner's key loop sees the stored rows."""
    cos, sin, qw, qwp, kw, kwp = rope
    q_rows = q_ptr + row * q_s0 + (kvh * GROUP).to(tl.int64) * q_s1
    q = _norm_rope_rows(q_rows, q_s1, GROUP, qw, qwp, cos, sin, eps, HEAD_DIM, HALF, BLOCK_H, BLOCK_D, HAS_Q_NORM)
    if owner:
        if slot >= 0:
            # the token's one head row as a 2-row tile (row 1 masked off): a 1-row tile is avoided, as elsewhere
            rows = tl.arange(0, 2)
            cols = (rows * 0)[:, None] + tl.arange(0, BLOCK_D)[None, :]
            d_mask = (rows < 1)[:, None] & (cols < HEAD_DIM)
            # v with k, before the first store (a load after a store it could alias is a round trip of its own)
            v = tl.load(v_ptr + row * v_s0 + kvh * v_s1 + cols, mask=d_mask, other=0.0)
            k = _norm_rope_rows(k_ptr + row * k_s0 + kvh * k_s1, k_s1, 1, kw, kwp, cos, sin, eps, HEAD_DIM, HALF, 2,
                                BLOCK_D, HAS_K_NORM)
            blk, off = slot // block_size, slot % block_size
            kc = k_cache_ptr + blk * kc_s0 + off * kc_s1 + kvh * kc_s2
            tl.store(kc + cols, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
            vc = v_cache_ptr + blk * vc_s0 + off * vc_s1 + kvh * vc_s2
            tl.store(vc + cols, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.debug_barrier()
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def _store_out(o_ptr, out, row, heads, o_s0, o_s1, offs_d, mask, g_ptr, g_s0, g_s1, GATED: tl.constexpr):
    """The attention output rounded to o's dtype; with GATED times the sigmoid of its output gate, each rounded to
    o's dtype as `sigmoid_gate_mul` rounds (Qwen3.5's gated attention, one launch fewer a layer)."""
    y = out.to(o_ptr.dtype.element_ty)
    if GATED:
        g = tl.load(g_ptr + row * g_s0 + heads[:, None] * g_s1 + offs_d[None, :], mask=mask, other=0.0)
        y = sigmoid_gated(y, g, o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * o_s0 + heads[:, None] * o_s1 + offs_d[None, :], y, mask=mask)


@triton.jit
def _merge_heads(mid_o_ptr, mid_lse_ptr, o_ptr, b, heads, h_mask, row, mo_s0, mo_s1, mo_s2, ml_s0, ml_s1, o_s0, o_s1,
                 num_splits, g_ptr, g_s0, g_s1, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 BLOCK_D: tl.constexpr, CACHE: tl.constexpr, GATED: tl.constexpr):
    """Query heads `heads` (`[G]`, `h_mask` valid) of sequence b: the LSE-weighted merge of their first `num_splits`
    splits' partials, written to the output row (zeros when every split was empty). All loads are issued before any
    store, as one `[G, splits, D]` tile. CACHE: the loads' cache modifier (".cg" when other SMs wrote them)."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
    lse = tl.load(mid_lse_ptr + b * ml_s0 + heads[:, None] * ml_s1 + offs_s[None, :], mask=hs_mask,
                  other=float("-inf"), cache_modifier=CACHE)
    parts = tl.load(
        mid_o_ptr + b * mo_s0 + (heads[:, None] * mo_s1 + offs_s[None, :] * mo_s2)[:, :, None] + offs_d[None, None, :],
        mask=hs_mask[:, :, None] & d_mask[None, None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(hs_mask, tl.exp(lse - m_safe[:, None]), 0.0)
    total = tl.sum(w, axis=1)
    out = tl.sum(parts * w[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    _store_out(o_ptr, out, row, heads, o_s0, o_s1, offs_d, h_mask[:, None] & d_mask[None, :], g_ptr, g_s0, g_s1, GATED)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, mid_o_ptr, mid_lse_ptr, o_ptr, seq_lens_ptr, bt_ptr, qsl_ptr, counter_ptr,
    k_ptr, v_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, g_ptr,
    q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, bt_s0, mo_s0, mo_s1, mo_s2, ml_s0, ml_s1, o_s0, o_s1,
    k_s0, k_s1, v_s0, v_s1, cs_stride, g_s0, g_s1, scale, eps, block_size, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, RAGGED: tl.constexpr, DIRECT: tl.constexpr,
    ROPE: tl.constexpr, HALF: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    MERGE: tl.constexpr, SPLITS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, GATED: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """With DIRECT (one split) the normalised output goes to the query row of `o_ptr` in its dtype and no partial
    is stored; else the partial and its LSE go to the workspace, which with MERGE the last program of the
    (sequence, KV head) merges into `o_ptr` (else the reduce kernel does). With ROPE q is the raw projection's
    and this program also does `qk_norm_rope_store`'s work for its token (`_rope_and_store_token`). With GATED the
    output is multiplied by the sigmoid of its gate (`g_ptr`, rows and heads as the output's) where it is written."""
    # Under PDL everything before `gdc_wait` reads only the step's inputs (lengths, rows, positions, slots, block
    # table: copied in before the step's first kernel) and constants (the rotary table, the norm weights): nothing a
    # kernel still running may write. The q / k / v rows and every store come after it.
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
    if HEADS_FASTEST:
        b = tl.program_id(1).to(tl.int64)
        kvh = tl.program_id(0)
        num_kv = tl.num_programs(0)
    else:
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        num_kv = tl.num_programs(1)
    sp = tl.program_id(2)
    row = _query_row(qsl_ptr, b, RAGGED)
    if row < 0:
        return  # not a one-token sequence: the prefill kernel owns its rows (and its workspace stays unread)
    ctx = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(ctx, start + chunk)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = (kvh * GROUP + offs_h).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    used = num_splits
    if MERGE:  # only the splits that hold keys take part: the first `used`; a padding row's first one writes zeros
        used = tl.cdiv(ctx, tl.maximum(chunk, 1))
        if ctx == 0:
            if sp == 0:
                if USE_PDL:
                    tl.extra.cuda.gdc_wait()
                tl.store(o_ptr + row * o_s0 + heads[:, None] * o_s1 + offs_d[None, :],
                         tl.zeros([BLOCK_H, BLOCK_D], o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
            return
        if sp >= used:
            return
    if ROPE:
        cos, sin = _rope_factors(cs_ptr + tl.load(pos_ptr + row).to(tl.int64) * cs_stride, HALF, BLOCK_D)
        qw, qwp = _norm_weights(qw_ptr, HEAD_DIM, HALF, BLOCK_D, HAS_Q_NORM)
        kw, kwp = _norm_weights(kw_ptr, HEAD_DIM, HALF, BLOCK_D, HAS_K_NORM)
        slot = tl.load(slot_ptr + row).to(tl.int64)
    # the first key tile's pages, a round trip off the chain after the wait (later tiles' one iteration ahead)
    bt_row = bt_ptr + b * bt_s0
    first_n = start + tl.arange(0, BLOCK_N)
    page = tl.load(bt_row + first_n // block_size, mask=first_n < end, other=0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if ROPE:
        owner = (ctx > 0) & (sp == (ctx - 1) // tl.maximum(chunk, 1))  # the split that holds the new token
        q = _rope_and_store_token(
            q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, (cos, sin, qw, qwp, kw, kwp), slot, row, kvh, owner,
            q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
            block_size, eps, GROUP, HEAD_DIM, HALF, BLOCK_H, BLOCK_D, HAS_Q_NORM, HAS_K_NORM,
        )
    else:
        q = tl.load(
            q_ptr + row * q_s0 + heads[:, None] * q_s1 + offs_d[None, :], mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kvh64 = kvh.to(tl.int64)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        in_page = (offs_n % block_size).to(tl.int64)
        k = tl.load(
            k_cache_ptr + (page * kc_s0 + in_page * kc_s1 + kvh64 * kc_s2)[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where(n_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + (page * vc_s0 + in_page * vc_s1 + kvh64 * vc_s2)[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        next_n = offs_n + BLOCK_N
        page = tl.load(bt_row + next_n // block_size, mask=next_n < end, other=0).to(tl.int64)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT or used == 1:  # one split (with MERGE: the only one holding keys) writes the output itself
        _store_out(o_ptr, out, row, heads, o_s0, o_s1, offs_d, out_mask, g_ptr, g_s0, g_s1, GATED)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(mid_o_ptr + b * mo_s0 + heads[:, None] * mo_s1 + sp * mo_s2 + offs_d[None, :], out, mask=out_mask)
        tl.store(mid_lse_ptr + b * ml_s0 + heads * ml_s1 + sp, lse, mask=h_mask)
        if MERGE:  # the split-K fix-up's arrival pattern (`split_k.last_arrival` says why this order is safe)
            tile = b * num_kv + kvh
            if split_k.last_arrival(counter_ptr + tile, used):
                tl.debug_barrier()
                group = tl.arange(0, GROUP_PAD)  # the group's heads only: not the 16-row tile of the dots
                _merge_heads(mid_o_ptr, mid_lse_ptr, o_ptr, b, kvh * GROUP + group.to(tl.int64), group < GROUP, row,
                             mo_s0, mo_s1, mo_s2, ml_s0, ml_s1, o_s0, o_s1, used, g_ptr, g_s0, g_s1, HEAD_DIM,
                             SPLITS_PAD, BLOCK_D, ".cg", GATED)
                tl.store(counter_ptr + tile, 0)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    qsl_ptr,
    mo_s0,
    mo_s1,
    mo_s2,
    ml_s0,
    ml_s1,
    o_s0,
    o_s1,
    num_splits,
    g_ptr,
    g_s0,
    g_s1,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RAGGED: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = _query_row(qsl_ptr, b, RAGGED)
    if row < 0:
        return
    one = tl.arange(0, 2) < 1  # the head as a 2-row tile (row 1 masked off)
    _merge_heads(mid_o_ptr, mid_lse_ptr, o_ptr, b, h + tl.arange(0, 2), one, row, mo_s0, mo_s1, mo_s2, ml_s0, ml_s1,
                 o_s0, o_s1, num_splits, g_ptr, g_s0, g_s1, HEAD_DIM, SPLITS_PAD, BLOCK_D, "", GATED)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough (batch x kv-head x split) programs for ~SPLIT_WAVES (2) waves over the SMs, at most MAX_SPLITS.

    Depends only on shapes that are fixed for a captured graph, never on context lengths."""
    if device.type != "cuda":
        return 4
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    work = max(1, batch * num_kv_heads)
    return max(1, min(MAX_SPLITS, triton.cdiv(SPLIT_WAVES * sms, work)))


# Up to this many sequences the key loop takes 32-key tiles at head_dim <= 128: a short context then splits into
# twice the tiles, so more of the (KV head, split) programs have keys to walk. Thirty-third session, H100, Qwen3-4B
# BF16 replays, two runs each (ms, 32 against 64 keys): context 400, 1 row 3.288 / 3.298 against 3.336 / 3.340, 2
# rows 3.528 / 3.607 against 3.648 / 3.641, 4 rows 3.552 / 3.620 against 3.632 / 3.562; context 1,500, 1 row equal
# (3.38 / 3.38 against 3.37 / 3.37), 2 rows 3.680 / 3.720 against 3.798 / 3.744, 4 rows 3.94 / 3.88 against 3.88 / 3.81.
SMALL_TILE_MAX_SEQS = 2


def _decode_config(head_dim: int, n_seq: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a batch of `n_seq` sequences (a graph's shape, never a context)."""
    if interpreting():
        return 16, 4, 1
    if head_dim <= 128:
        return TILE or ((32, 4, 2) if n_seq <= SMALL_TILE_MAX_SEQS else (64, 4, 2))
    return 32, 4, 2


def _merge_counters(device: torch.device, n_seq: int, num_kv_heads: int) -> torch.Tensor | None:
    """The arrival counters for an in-kernel merge (the split-K fix-up's, shared: launches on the one stream never
    overlap), or None: the reduce kernel merges (the merge fusion off, or `split_k.counters_for`'s reasons)."""
    return split_k.counters_for(n_seq * num_kv_heads, device) if FUSED_MERGE else None


def _check_rope(rope: DecodeRope, q: torch.Tensor, num_kv_heads: int) -> int:
    """Rope's shapes against q's; returns the rotary half width."""
    n_tok, _, head_dim = q.shape
    if rope.k.shape != (n_tok, num_kv_heads, head_dim) or rope.v.shape != rope.k.shape:
        raise ValueError(f"k {tuple(rope.k.shape)} / v {tuple(rope.v.shape)} do not match q {tuple(q.shape)}")
    rotary_dim = rope.cos_sin_cache.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos_sin_cache last dim {rotary_dim}: the rotary dims must be even and in (0, {head_dim}]")
    for name, t in (("k", rope.k), ("v", rope.v), ("cos_sin_cache", rope.cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    return rotary_dim // 2


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    merge_in_kernel: bool = True,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[B, Hq, D]` (one token per sequence), caches `[num_blocks, block_size, Hkv, D]`, seq_lens `[B]`
    (0 = padding row -> zeros), block_tables `[B, max_blocks]` -> `[B, Hq, D]` in q's dtype.

    With `query_start_loc` (`[B+1]`) the batch is ragged (a mixed step): q and out are `[T, Hq, D]`, and only the
    sequences whose query length is 1 are computed, each into its row `query_start_loc[b]`; the other rows are
    left unwritten (the prefill kernel's, with `skip_single_token`). The lengths are read on the device, so the
    launch (and `num_splits`, from B) depends on shapes only.

    With `rope` q is the raw projection's and pass 1 first does `qk_norm_rope_store`'s work (module docstring) for
    the rows it computes; in a ragged batch, `qk_norm_rope_store(..., skip_single_token_of=query_start_loc)` does
    the other rows'. `merge_in_kernel`: the last split program merges (when the counters exist), else the
    reduce kernel. `output_gate` (q's shape, any row and head strides): the output times its sigmoid, rounded as
    `sigmoid_gate_mul` (a padding row's zeros stay zeros)."""
    n_tok, num_q_heads, head_dim = q.shape
    n_seq = seq_lens.shape[0]
    _, block_size, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    ragged = query_start_loc is not None
    if ragged and query_start_loc.shape[0] != n_seq + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {n_seq} sequences")
    if not ragged and n_tok != n_seq:
        raise ValueError(f"decode needs one query row per sequence: q has {n_tok} rows, {n_seq} sequences")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if output_gate is not None:
        if output_gate.shape != q.shape:
            raise ValueError(f"output gate {tuple(output_gate.shape)} does not match q {tuple(q.shape)}")
        check_last_dim_contiguous("output gate", output_gate)
    gate = output_gate if output_gate is not None else q  # unread unless GATED
    half = _check_rope(rope, q, num_kv_heads) if rope is not None else 1
    if out is None:
        out = torch.empty((n_tok, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_seq == 0 or n_tok == 0:
        return out
    group = num_q_heads // num_kv_heads
    splits = int(num_splits or choose_num_splits(n_seq, num_kv_heads, q.device))
    splits = max(1, min(splits, MAX_SPLITS))
    bn, num_warps, num_stages = _decode_config(head_dim, n_seq)
    bn = block_n or bn
    block_d = max(16, next_pow2(head_dim))
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    direct = splits == 1
    counters = None if direct or not merge_in_kernel else _merge_counters(q.device, n_seq, num_kv_heads)
    if direct:  # pass 1 writes `out`; the workspace is not touched (1-element stand-ins)
        mid_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=q.device)
    else:
        mid_o = torch.empty((n_seq, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((n_seq, num_q_heads, splits), dtype=torch.float32, device=q.device)
    splits_pad = MAX_SPLITS if ragged else max(2, next_pow2(splits))
    r = rope
    if r is not None:
        positions = r.positions if r.positions.is_contiguous() else r.positions.contiguous()
        slots = r.slot_mapping if r.slot_mapping.is_contiguous() else r.slot_mapping.contiguous()
    grid = (num_kv_heads, n_seq, splits) if HEADS_FASTEST else (n_seq, num_kv_heads, splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, mid_o, mid_lse, out, seq_lens, block_tables,
        query_start_loc if ragged else seq_lens,  # unread unless RAGGED
        counters if counters is not None else seq_lens,  # unread unless MERGE
        *((r.k, r.v, positions, r.cos_sin_cache, r.q_norm_weight if r.q_norm_weight is not None else q,
           r.k_norm_weight if r.k_norm_weight is not None else q, slots) if r is not None else (q,) * 7),
        gate,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), 0 if direct else mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        *((r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos_sin_cache.stride(0))
          if r is not None else (0,) * 5),
        gate.stride(0), gate.stride(1),
        float(scale),
        float(r.eps) if r is not None else 0.0,
        block_size,
        splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=bn,
        BLOCK_D=block_d,
        DOT_F32=dot_in_fp32(q.dtype),
        RAGGED=ragged,
        DIRECT=direct,
        ROPE=r is not None,
        HALF=half,
        HAS_Q_NORM=r is not None and r.q_norm_weight is not None,
        HAS_K_NORM=r is not None and r.k_norm_weight is not None,
        MERGE=counters is not None,
        SPLITS_PAD=splits_pad,
        GROUP_PAD=max(2, next_pow2(group)),
        GATED=output_gate is not None,
        HEADS_FASTEST=HEADS_FASTEST,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q.device),
    )
    if direct or counters is not None:
        return out
    _decode_reduce_kernel[(n_seq, num_q_heads)](
        mid_o,
        mid_lse,
        out,
        query_start_loc if ragged else seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        gate,
        gate.stride(0),
        gate.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=splits_pad,
        BLOCK_D=block_d,
        RAGGED=ragged,
        GATED=output_gate is not None,
        num_warps=1 if block_d <= 128 else 2,
        **pdl_launch(q.device),
    )
    return out
