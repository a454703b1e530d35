"""Chunked gated delta rule (the WY form, chunks of 64 tokens) over a ragged batch with state slots (prefill).

Two launches. Per chunk, with `G` the in-chunk cumulative log decay, `kb = beta * k` and
`M = strict_lower(kb k^T * exp(G_i - G_j))`, the chunk-local pass (one program per chunk of the batch and
value head, all in parallel) computes

    T = (I + M)^-1                      (forward substitution, row by row)
    u = T (beta * v),  w = T (kb * exp(G))

into fp32 scratch; then the sequential pass (one program per sequence, value head and block of value columns)
walks the sequence's chunks, carrying its `[Dk, BV]` slice of the fp32 state in registers from the slot and back:

    v' = u - w S
    o = (q * exp(G)) S + lower(q k^T * exp(G_i - G_j)) v'
    S = exp(G_last) S + (k * exp(G_last - G))^T v'

which is transformers' `torch_chunk_gated_delta_rule` (q, k L2-normalised and q scaled inside). Everything is
fp32 and every product an IEEE fp32 `tl.dot`, so the result equals the per-token recurrence up to fp32
rounding. Tokens past a sequence's end load as zeros (k = v = beta = g = 0), which leaves the state unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels._ragged import STEP_SIZE_ARGS, batch_block, ragged_block_b
from infer_backend_cuda.kernels.gdn_recurrent import prepare_gdn_out, sequence_head_block

CHUNK = 64


@triton.jit
def _l2_rows(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit(do_not_specialize=STEP_SIZE_ARGS + ("min_len",))
def _gdn_chunk_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, cu_ptr,
    k_st, k_sh, v_st, v_sh, g_st, beta_st, w_st, w_sh, u_st, u_sh,
    DK, DV, GROUP, n_seq, min_len,
    CH: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Chunk-local pass, one program per (chunk of the batch, value head): T = (I + M)^-1, then
    w = T (kb * exp(G)) and u = T (beta * v) into the fp32 scratch rows of the chunk."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    h = tl.program_id(1)
    seq, chunk = batch_block(cu_ptr, n_seq, pid, CH, BLOCK_B, 1)
    # Past the batch's last chunk (the grid is an upper bound) and short rows (the recurrent kernel's) exit.
    n = tl.load(cu_ptr + seq + 1, mask=seq < n_seq, other=0).to(tl.int64) - tl.load(cu_ptr + seq, mask=seq < n_seq, other=0)
    if (seq < n_seq) & (n >= min_len):
        c0 = chunk * CH
        bos = tl.load(cu_ptr + seq).to(tl.int64)
        ci = tl.arange(0, CH)
        kk = tl.arange(0, BK)
        dd = tl.arange(0, BDV)
        rows = bos + c0 + ci
        tm = (c0 + ci) < n
        kmask = tm[:, None] & (kk < DK)[None, :]
        vmask = tm[:, None] & (dd < DV)[None, :]
        k = tl.load(k_ptr + rows[:, None] * k_st + (h // GROUP) * k_sh + kk[None, :], mask=kmask, other=0.0)
        k = _l2_rows(k.to(tl.float32))
        v = tl.load(v_ptr + rows[:, None] * v_st + h * v_sh + dd[None, :], mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * g_st + h, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=tm, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        lower_strict = ci[:, None] > ci[None, :]
        decay = tl.exp(tl.where(lower_strict, gc[:, None] - gc[None, :], 0.0))
        kb = k * beta[:, None]
        m = tl.where(lower_strict, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
        # Forward substitution, row by row: T[i, :] = e_i - M[i, :i] T[:i, :]. (Numerically stable where the
        # Neumann product (I - M)(I + M^2)... is not: powers of M grow combinatorially for similar keys.)
        t_inv = tl.zeros((CH, CH), dtype=tl.float32)
        for i in range(0, CH):
            m_row = tl.sum(tl.where(ci[:, None] == i, m, 0.0), axis=0)
            row = tl.where(ci == i, 1.0, 0.0) - tl.sum(m_row[:, None] * t_inv, axis=0)
            t_inv = tl.where(ci[:, None] == i, row[None, :], t_inv)
        w = tl.dot(t_inv, kb * tl.exp(gc)[:, None], input_precision="ieee")
        u = tl.dot(t_inv, v * beta[:, None], input_precision="ieee")
        tl.store(w_ptr + rows[:, None] * w_st + h * w_sh + kk[None, :], w, mask=kmask)
        tl.store(u_ptr + rows[:, None] * u_st + h * u_sh + dd[None, :], u, mask=vmask)


@triton.jit(do_not_specialize=("min_len",))
def _gdn_chunk_state_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st, beta_st, o_st, o_sh,
    s_ss, s_sh, s_sk,
    DK, DV, GROUP, scale, min_len,
    w_ptr, u_ptr, w_st, w_sh, u_st, u_sh,
    CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Sequential pass, one program per (sequence, value head, value block): walks the chunks with the state
    tile in registers (v' = u - w S, the chunk's output, the state update)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    hk, h, bos, n, kk, vv, km, vm, s_ptrs, smask = sequence_head_block(
        cu_ptr, slot_ptr, state_ptr, s_ss, s_sh, s_sk, DK, DV, GROUP, BK, BV
    )
    ci = tl.arange(0, CH)
    lower = ci[:, None] >= ci[None, :]
    state = tl.load(s_ptrs, mask=smask, other=0.0)
    for c0 in range(0, tl.where(n >= min_len, n, 0), CH):
        rows = bos + c0 + ci
        tm = (c0 + ci) < n
        qkm = tm[:, None] & km[None, :]
        vmask = tm[:, None] & vm[None, :]
        q = tl.load(q_ptr + rows[:, None] * q_st + hk * q_sh + kk[None, :], mask=qkm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * k_st + hk * k_sh + kk[None, :], mask=qkm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * w_st + h * w_sh + kk[None, :], mask=qkm, other=0.0)
        u = tl.load(u_ptr + rows[:, None] * u_st + h * u_sh + vv[None, :], mask=vmask, other=0.0)
        g = tl.load(g_ptr + rows * g_st + h, mask=tm, other=0.0).to(tl.float32)
        q = _l2_rows(q) * scale
        k = _l2_rows(k)
        gc = tl.cumsum(g, axis=0)
        v_new = u - tl.dot(w, state, input_precision="ieee")
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
        qk = tl.where(lower, tl.dot(q, tl.trans(k), input_precision="ieee") * decay, 0.0)
        o = tl.dot(q * tl.exp(gc)[:, None], state, input_precision="ieee")
        o += tl.dot(qk, v_new, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * o_st + h * o_sh + vv[None, :], o.to(out_ptr.dtype.element_ty), mask=vmask)
        g_last = tl.sum(tl.where(ci == CH - 1, gc, 0.0), axis=0)
        k_end = k * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_end), v_new, input_precision="ieee")
    tl.store(s_ptrs, state, mask=smask)


def gdn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None,
    min_len: int = 0,
) -> torch.Tensor:
    """The gated delta rule in chunks of 64 tokens (same operands and result as `gdn_recurrent`), for the
    sequences of at least `min_len` tokens; the others' output rows and state slots are left untouched."""
    out = prepare_gdn_out(q, k, v, g, beta, states, cu_seqlens, slot_ids, out)
    n_seq, dk, hv, dv = slot_ids.shape[0], q.shape[2], v.shape[1], v.shape[2]
    if n_seq == 0 or q.shape[0] == 0:
        return out
    bk = max(16, next_pow2(dk))  # tl.dot needs every dimension >= 16
    bdv = max(16, next_pow2(dv))
    # 32 value columns per program: a single Qwen3.5 prefill (32 heads) then fills ~128 SMs.
    bv = min(bdv, 32)
    # fp32 scratch of the chunk-local pass: w `[T, Hv, Dk]`, u `[T, Hv, Dv]` (33 MB per 1k tokens at Qwen3.5-4B).
    w = torch.empty((q.shape[0], hv, dk), dtype=torch.float32, device=q.device)
    u = torch.empty((q.shape[0], hv, dv), dtype=torch.float32, device=q.device)
    pdl = pdl_launch(q.device)
    # Every sequence's chunks but its last are full, so the batch has at most cdiv(T, 64) + B of them: the grid
    # is bounded by the step's tokens, not by B x max_query_len (a mixed step of many decode rows).
    _gdn_chunk_wy_kernel[(triton.cdiv(q.shape[0], CHUNK) + n_seq, hv)](
        k, v, g, beta, w, u, cu_seqlens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        dk, dv, hv // q.shape[1], n_seq, min_len,
        CH=CHUNK, BK=bk, BDV=bdv, BLOCK_B=ragged_block_b(n_seq), num_warps=8, **pdl,
    )
    _gdn_chunk_state_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, states, out, cu_seqlens, slot_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
        dk, dv, hv // q.shape[1], float(dk) ** -0.5, min_len,
        w, u, w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        CH=CHUNK, BK=bk, BV=bv, num_warps=8, **pdl,
    )
    return out
