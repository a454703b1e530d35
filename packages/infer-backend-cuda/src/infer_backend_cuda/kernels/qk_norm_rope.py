"""Per-head QK-RMSNorm + NeoX RoPE (full or partial) on q and k, fused with the paged KV-cache store of k and v.

One program per token handles all its heads as `[heads, D/2]` register tiles: it reads the q heads,
optionally RMS-normalises each head row (Qwen3's per-head q_norm), rotates them with the position's
cos/sin (loaded once per token) and writes the rotated q; it does the same for the k heads with k_norm and
additionally writes the rotated k rows and the v rows into the paged caches at `slot_mapping[t]`
(`block = slot // block_size`, `offset = slot % block_size`); slot -1 (padding) writes nothing to the caches. One read of q/k/v + cos/sin, one write of q/k + the cache
rows, instead of four to six separate passes.

Partial rotary (Qwen3.5: 64 of 256 dims): the cos/sin cache has `R < D` columns; a head row is handled as the two
rotary halves `[0, R/2)`, `[R/2, R)` and the pass-through rest `[R, D)`, which is normed but not rotated.

Rounding mirrors the unfused reference: the normed row is rounded to the activation dtype before the
rotation (as when the norm output is materialised), the rotation itself runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import check_last_dim_contiguous, next_pow2, pdl_launch
from infer_backend_cuda.kernels._ragged import STEP_SIZE_ARGS, ragged_block_b


@triton.jit
def _norm_rope_tile(
    src_ptr,
    head_stride,
    n_heads,
    w_ptr,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    PASS: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Load the `[n_heads, HEAD_DIM]` rows of one token as the two rotary halves `[HEADS_BLOCK, HALF_BLOCK]`
    (dims `[0, HALF)` and `[HALF, 2 HALF)`) and the pass-through part `[HEADS_BLOCK, PASS_BLOCK]` (dims
    `[2 HALF, HEAD_DIM)`, empty without partial rotary), RMS-normalise each head row over all its dims (optional)
    and rotate the halves; returns the three parts in fp32 and the masks of the halves and of the rest."""
    offs_h = tl.arange(0, HEADS_BLOCK)
    offs_d = tl.arange(0, HALF_BLOCK)
    offs_p = tl.arange(0, PASS_BLOCK)
    hmask = (offs_h < n_heads)[:, None]
    mask = hmask & (offs_d < HALF)[None, :]
    pmask = hmask & (offs_p < PASS)[None, :]
    ptrs = src_ptr + offs_h[:, None] * head_stride + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    x3 = tl.load(src_ptr + offs_h[:, None] * head_stride + 2 * HALF + offs_p[None, :], mask=pmask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x3 = x3.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
        dmask = offs_d < HALF
        w1 = tl.load(w_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + 2 * HALF + offs_p, mask=offs_p < PASS, other=0.0).to(tl.float32)
        x1 = (x1 * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
        x3 = (x3 * rstd[:, None] * w3[None, :]).to(dt).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    return o1, o2, x3, mask, pmask


@triton.jit
def _store_row_parts(
    dst_ptr, head_stride, p1, p2, p3, mask, pmask,
    HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr,
):
    """Store the three parts of `_norm_rope_tile` as `[heads, HEAD_DIM]` rows at `dst_ptr`."""
    rows = dst_ptr + tl.arange(0, HEADS_BLOCK)[:, None] * head_stride
    ptrs = rows + tl.arange(0, HALF_BLOCK)[None, :]
    ty = dst_ptr.dtype.element_ty
    tl.store(ptrs, p1.to(ty), mask=mask)
    tl.store(ptrs + HALF, p2.to(ty), mask=mask)
    tl.store(rows + 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :], p3.to(ty), mask=pmask)


@triton.jit(do_not_specialize=STEP_SIZE_ARGS)
def _qk_norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cs_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    qsl_ptr,
    n_seq,
    q_s0,
    q_s1,
    k_s0,
    k_s1,
    v_s0,
    v_s1,
    qo_s0,
    qo_s1,
    ko_s0,
    ko_s1,
    cs_stride,
    kc_s0,
    kc_s1,
    kc_s2,
    vc_s0,
    vc_s1,
    vc_s2,
    block_size,
    num_q_heads,
    num_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    PASS: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
    QH_BLOCK: tl.constexpr,
    KH_BLOCK: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Under PDL only the step's inputs (`query_start_loc`) are read before `gdc_wait`.
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    if SKIP_SINGLE:  # a one-token sequence's row (`query_start_loc[b] == t`, `[b + 1] == t + 1`) is the decode kernel's
        offs_b = tl.arange(0, BLOCK_B)
        b_mask = offs_b < n_seq
        starts = tl.load(qsl_ptr + offs_b, mask=b_mask, other=-1).to(tl.int64)
        ends = tl.load(qsl_ptr + offs_b + 1, mask=b_mask, other=-1).to(tl.int64)
        if tl.sum(((starts == t) & (ends == t + 1)).to(tl.int32), axis=0) > 0:
            return
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_BLOCK)
    dmask = offs_d < HALF
    cos = tl.load(cs_ptr + pos * cs_stride + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * cs_stride + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)

    # q: all heads of this token
    q1, q2, q3, qmask, qpmask = _norm_rope_tile(
        q_ptr + t * q_s0, q_s1, num_q_heads, qw_ptr, cos, sin, eps,
        HEAD_DIM, HALF, HALF_BLOCK, PASS, PASS_BLOCK, QH_BLOCK, HAS_Q_NORM,
    )
    _store_row_parts(q_out_ptr + t * qo_s0, qo_s1, q1, q2, q3, qmask, qpmask, HALF, HALF_BLOCK, PASS_BLOCK, QH_BLOCK)

    # k: all KV heads, rotated k to k_out and (unless slot < 0) k and v rows to the paged caches
    k1, k2, k3, kmask, kpmask = _norm_rope_tile(
        k_ptr + t * k_s0, k_s1, num_kv_heads, kw_ptr, cos, sin, eps,
        HEAD_DIM, HALF, HALF_BLOCK, PASS, PASS_BLOCK, KH_BLOCK, HAS_K_NORM,
    )
    k1 = k1.to(k_out_ptr.dtype.element_ty)
    k2 = k2.to(k_out_ptr.dtype.element_ty)
    k3 = k3.to(k_out_ptr.dtype.element_ty)
    _store_row_parts(k_out_ptr + t * ko_s0, ko_s1, k1, k2, k3, kmask, kpmask, HALF, HALF_BLOCK, PASS_BLOCK, KH_BLOCK)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # (the interpreter takes no scalar in a mask: the slot test is broadcast through a zero tile)
    smask = kmask & ((tl.zeros([KH_BLOCK, HALF_BLOCK], tl.int64) + slot) >= 0)
    spmask = kpmask & ((tl.zeros([KH_BLOCK, PASS_BLOCK], tl.int64) + slot) >= 0)
    blk = slot // block_size
    off = slot % block_size
    kc = k_cache_ptr + blk * kc_s0 + off * kc_s1
    _store_row_parts(kc, kc_s2, k1, k2, k3, smask, spmask, HALF, HALF_BLOCK, PASS_BLOCK, KH_BLOCK)
    offs_kh = tl.arange(0, KH_BLOCK)
    vsrc = v_ptr + t * v_s0 + offs_kh[:, None] * v_s1
    v1 = tl.load(vsrc + offs_d[None, :], mask=smask, other=0.0)
    v2 = tl.load(vsrc + HALF + offs_d[None, :], mask=smask, other=0.0)
    v3 = tl.load(vsrc + 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :], mask=spmask, other=0.0)
    vc = v_cache_ptr + blk * vc_s0 + off * vc_s1
    _store_row_parts(vc, vc_s2, v1, v2, v3, smask, spmask, HALF, HALF_BLOCK, PASS_BLOCK, KH_BLOCK)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    skip_single_token_of: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` (any row/head strides, contiguous last dim), positions `[T]`,
    cos_sin_cache `[max_pos, R]` (cos first half, sin second half; `R <= D` rotary dims: with `R < D` only the
    first R dims of each head rotate, NeoX style within them, and the rest pass through), caches
    `[num_blocks, block_size, Hkv, D]`, slot_mapping `[T]` (-1 = skip). Returns new rotated (q, k) tensors;
    q/k/v are not modified.

    `skip_single_token_of` (a mixed batch's `query_start_loc`, `[B+1]`, read on the device): the rows of its
    one-token sequences are left alone (their q_out / k_out rows unwritten, their slots not stored), as the decode
    kernel with a `DecodeRope` does their share in the same step."""
    n_tok, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (n_tok, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos_sin_cache last dim {rotary_dim}: the rotary dims must be even and in (0, {head_dim}]")
    if k_cache.shape[1:] != (k_cache.shape[1], num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match [N, bs, {num_kv_heads}, {head_dim}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if q_out is None:
        q_out = torch.empty((n_tok, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((n_tok, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if n_tok == 0:
        return q_out, k_out
    positions = positions if positions.is_contiguous() else positions.contiguous()
    slot_mapping = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    n_seq = 0 if skip_single_token_of is None else skip_single_token_of.shape[0] - 1
    has_q, has_k = q_norm_weight is not None, k_norm_weight is not None
    qh_block, kh_block, half_block = next_pow2(num_q_heads), next_pow2(num_kv_heads), next_pow2(half)
    pass_block = max(2, next_pow2(rest))  # a 1-wide tile is avoided, as elsewhere (SPLITS_PAD)
    tile = (qh_block + 2 * kh_block) * (half_block * 2 + (pass_block if rest else 0))
    _qk_norm_rope_store_kernel[(n_tok,)](
        q,
        k,
        v,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        q_norm_weight if has_q else q,
        k_norm_weight if has_k else k,
        k_cache,
        v_cache,
        slot_mapping,
        skip_single_token_of if skip_single_token_of is not None else slot_mapping,  # unread unless SKIP_SINGLE
        n_seq,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        num_q_heads,
        num_kv_heads,
        float(eps),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_BLOCK=half_block,
        PASS=rest,
        PASS_BLOCK=pass_block,
        QH_BLOCK=qh_block,
        KH_BLOCK=kh_block,
        HAS_Q_NORM=has_q,
        HAS_K_NORM=has_k,
        SKIP_SINGLE=skip_single_token_of is not None,
        BLOCK_B=ragged_block_b(n_seq),
        num_warps=2 if tile <= 2048 else (4 if tile <= 8192 else 8),
        **pdl_launch(q.device),
    )
    return q_out, k_out
